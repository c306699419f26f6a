// A small etcd v3 client over etcd's HTTP/JSON gateway (grpc-gateway), with
// libcurl for HTTP and nlohmann-json for JSON. Why the gateway and not gRPC:
// docs/directory.md.
//
// One client = one HTTP handle (http_client.h), used by one call at a time (a mutex), so the
// Directory gives its keep-alive thread a client of its own. Every request is
// bounded by the connect and request timeouts; errors name the endpoint and
// what was asked ("range of key /ferry/engines/a/metadata").
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "directory/http_client.h"
#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry::directory {

struct EtcdKeyValue {
  std::string key;
  Bytes value;
  int64_t lease = 0;  // 0 = no lease
  int64_t create_revision = 0;
};

struct EtcdClientOptions {
  std::vector<std::string> endpoints;  // "host:port", tried in order on failure
  std::chrono::milliseconds connect_timeout{1000};
  std::chrono::milliseconds request_timeout{3000};
  std::string gateway_prefix;  // "" = from /version
};

// The outcome of a create-if-absent transaction.
struct EtcdClaim {
  bool created = false;
  // When not created: the key that was already there, and the value of
  // `also_read` (e.g. its holder note) if present.
  std::optional<EtcdKeyValue> existing;
  std::optional<EtcdKeyValue> also_read;
};

class EtcdClient {
 public:
  explicit EtcdClient(EtcdClientOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // GET /version on each endpoint until one answers; picks the gateway prefix.
  // PeerDisconnected naming every endpoint when none answers.
  Status probe();
  // "127.0.0.1:2379": the endpoint answering now.
  std::string endpoint() const;
  const std::string& gateway_prefix() const { return prefix_; }
  // "3.4.23" from /version (after probe()).
  const std::string& server_version() const { return server_version_; }

  Result<std::optional<EtcdKeyValue>> get(std::string_view key);
  // Every key starting with `key_prefix`, sorted by key.
  Result<std::vector<EtcdKeyValue>> get_prefix(std::string_view key_prefix, bool keys_only);
  Status put(std::string_view key, ByteView value, int64_t lease);
  // Puts every (key, value) under `lease` only if `guard` does not exist
  // (create_revision == 0); otherwise reads `guard` and `also_read`.
  Result<EtcdClaim> create_if_absent(std::string_view guard,
                                     const std::vector<std::pair<std::string, Bytes>>& puts,
                                     int64_t lease, std::string_view also_read);
  // Puts (key, value) under `lease` only if `guard` exists under that lease.
  // false when it does not (the guard is gone or held by another lease).
  Result<bool> put_if_lease(std::string_view guard, std::string_view key, ByteView value,
                            int64_t lease);
  // Deletes every key starting with `key_prefix` if `guard` is held by `lease`.
  Result<bool> delete_prefix_if_lease(std::string_view guard, std::string_view key_prefix,
                                      int64_t lease);

  Result<int64_t> lease_grant(int64_t ttl_seconds);
  // The remaining ttl after a refresh; 0 when the lease no longer exists.
  Result<int64_t> lease_keepalive(int64_t lease);
  // Remaining ttl, -1 when the lease does not exist.
  Result<int64_t> lease_time_to_live(int64_t lease);
  Status lease_revoke(int64_t lease);

 private:
  struct Response;
  // POSTs `body` (JSON text) to gateway path `path` ("/kv/range"), failing over
  // to the next endpoint on a transport error. `what` names the request.
  Result<std::string> post(std::string_view path, const std::string& body, std::string_view what);
  // post() and the answer parsed as JSON, gateway errors mapped to codes.
  Result<nlohmann::json> call(std::string_view path, const std::string& body,
                              std::string_view what);
  Result<Response> perform(const std::string& endpoint, const std::string& url,
                           const std::string* body);
  Status probe_one(const std::string& endpoint);

  EtcdClientOptions options_;
  mutable std::mutex mu_;  // one request at a time on http_
  HttpClient http_;
  size_t current_ = 0;  // index into options_.endpoints
  std::string prefix_;  // "/v3"
  std::string server_version_;
};

}  // namespace ferry::directory
