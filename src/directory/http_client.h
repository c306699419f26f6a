// One HTTP connection of the etcd client (etcd_client.h). Two builds of it:
// http_client_curl.cc -- libcurl, opened with dlopen on first use -- and, in a
// build made without libcurl's headers (`pip install .` on a machine without
// libcurl4-openssl-dev), http_client_unavailable.cc, which answers every
// request NotSupported with that reason.
#pragma once

#include <chrono>
#include <string>

#include "ferry/status.h"

namespace ferry::directory {

struct HttpResponse {
  long status = 0;  // HTTP status code
  std::string body;
};

// Not thread-safe: one request at a time (EtcdClient holds a mutex).
class HttpClient {
 public:
  HttpClient();
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // GET `url` (body null) or POST `*body` as JSON. A transport failure is
  // PeerDisconnected (Timeout past `request_timeout`), naming `endpoint`; an
  // HTTP error status is a response, for the caller to read.
  Result<HttpResponse> request(const std::string& endpoint, const std::string& url,
                               const std::string* body, std::chrono::milliseconds connect_timeout,
                               std::chrono::milliseconds request_timeout);

 private:
  void* handle_ = nullptr;  // CURL*
};

}  // namespace ferry::directory
