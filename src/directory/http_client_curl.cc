// HttpClient over libcurl (http_client.h).
#include "directory/http_client.h"

// Calls go through function pointers (dlopen), not the type-checking macros.
#define CURL_DISABLE_TYPECHECK 1
#include <curl/curl.h>
#include <dlfcn.h>
#include <fmt/format.h>

namespace ferry::directory {
namespace {

// libcurl is opened with dlopen when the first directory is, not linked: a
// program (or wheel) that never opens a directory does not load it and the
// thirty libraries it pulls in (TLS, Kerberos, LDAP, ...). The headers give
// the types; these are the entry points used.
struct CurlApi {
  CURLcode (*global_init)(long) = nullptr;
  CURL* (*easy_init)() = nullptr;
  void (*easy_cleanup)(CURL*) = nullptr;
  void (*easy_reset)(CURL*) = nullptr;
  CURLcode (*easy_setopt)(CURL*, CURLoption, ...) = nullptr;
  CURLcode (*easy_perform)(CURL*) = nullptr;
  CURLcode (*easy_getinfo)(CURL*, CURLINFO, ...) = nullptr;
  const char* (*easy_strerror)(CURLcode) = nullptr;
  curl_slist* (*slist_append)(curl_slist*, const char*) = nullptr;
  void (*slist_free_all)(curl_slist*) = nullptr;
  std::string error;  // why it could not be loaded; "" when loaded
};

template <typename F>
bool resolve(void* lib, const char* name, F& fn, std::string& error) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!fn && error.empty()) error = fmt::format("libcurl has no {}", name);
  return fn != nullptr;
}

const CurlApi& curl_api() {
  static const CurlApi api = [] {
    CurlApi a;
    void* lib = nullptr;
    std::string tried;
    for (const char* name : {"libcurl.so.4", "libcurl-gnutls.so.4", "libcurl.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib) break;
      tried += fmt::format("{}{}", tried.empty() ? "" : "; ", dlerror());
    }
    if (!lib) {
      a.error = fmt::format(
          "the etcd directory needs libcurl (Debian package libcurl4), which could not be "
          "loaded: {}",
          tried);
      return a;
    }
    resolve(lib, "curl_global_init", a.global_init, a.error);
    resolve(lib, "curl_easy_init", a.easy_init, a.error);
    resolve(lib, "curl_easy_cleanup", a.easy_cleanup, a.error);
    resolve(lib, "curl_easy_reset", a.easy_reset, a.error);
    resolve(lib, "curl_easy_setopt", a.easy_setopt, a.error);
    resolve(lib, "curl_easy_perform", a.easy_perform, a.error);
    resolve(lib, "curl_easy_getinfo", a.easy_getinfo, a.error);
    resolve(lib, "curl_easy_strerror", a.easy_strerror, a.error);
    resolve(lib, "curl_slist_append", a.slist_append, a.error);
    resolve(lib, "curl_slist_free_all", a.slist_free_all, a.error);
    if (a.error.empty() && a.global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
      a.error = "curl_global_init failed";
    }
    return a;
  }();
  return api;
}

size_t append_to_string(char* data, size_t size, size_t count, void* user) {
  static_cast<std::string*>(user)->append(data, size * count);
  return size * count;
}

}  // namespace

HttpClient::HttpClient() {
  const CurlApi& api = curl_api();
  if (api.error.empty()) handle_ = api.easy_init();
}

HttpClient::~HttpClient() {
  if (handle_) curl_api().easy_cleanup(static_cast<CURL*>(handle_));
}

Result<HttpResponse> HttpClient::request(const std::string& endpoint, const std::string& url,
                                         const std::string* body,
                                         std::chrono::milliseconds connect_timeout,
                                         std::chrono::milliseconds request_timeout) {
  const CurlApi& api = curl_api();
  if (!api.error.empty()) return err::NotSupported(api.error);
  auto* curl = static_cast<CURL*>(handle_);
  if (!curl) return err::Internal("curl_easy_init failed");
  HttpResponse response;
  char error_text[CURL_ERROR_SIZE] = {};
  api.easy_reset(curl);
  api.easy_setopt(curl, CURLOPT_URL, url.c_str());
  api.easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);  // threads: no SIGALRM for timeouts
  api.easy_setopt(curl, CURLOPT_PROXY, "");     // never through http_proxy
  api.easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(connect_timeout.count()));
  api.easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(request_timeout.count()));
  api.easy_setopt(curl, CURLOPT_ERRORBUFFER, error_text);
  api.easy_setopt(curl, CURLOPT_WRITEFUNCTION, append_to_string);
  api.easy_setopt(curl, CURLOPT_WRITEDATA, &response.body);
  curl_slist* headers = nullptr;
  if (body) {
    headers = api.slist_append(headers, "Content-Type: application/json");
    api.easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
    api.easy_setopt(curl, CURLOPT_POSTFIELDS, body->data());
    api.easy_setopt(curl, CURLOPT_POSTFIELDSIZE, static_cast<long>(body->size()));
  } else {
    api.easy_setopt(curl, CURLOPT_HTTPGET, 1L);
  }
  const CURLcode rc = api.easy_perform(curl);
  api.slist_free_all(headers);
  if (rc != CURLE_OK) {
    const std::string detail = error_text[0] ? error_text : api.easy_strerror(rc);
    if (rc == CURLE_OPERATION_TIMEDOUT) {
      return err::Timeout(fmt::format("etcd at {} did not answer within {} ms: {}", endpoint,
                                      request_timeout.count(), detail));
    }
    return err::PeerDisconnected(fmt::format("etcd at {} is unreachable: {}", endpoint, detail));
  }
  api.easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  return response;
}

}  // namespace ferry::directory
