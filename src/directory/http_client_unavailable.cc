// HttpClient in a build made without libcurl's headers (http_client.h): the
// etcd directory cannot be used, and says why.
#include "directory/http_client.h"

namespace ferry::directory {

HttpClient::HttpClient() = default;
HttpClient::~HttpClient() = default;

Result<HttpResponse> HttpClient::request(const std::string& endpoint, const std::string&,
                                         const std::string*, std::chrono::milliseconds,
                                         std::chrono::milliseconds) {
  return err::NotSupported(
      "the etcd directory (" + endpoint +
      ") is not in this build of Ferry: libcurl's headers (Debian libcurl4-openssl-dev) were "
      "absent when it was built");
}

}  // namespace ferry::directory
