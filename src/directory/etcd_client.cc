#include "directory/etcd_client.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/base64.h"

namespace ferry::directory {
namespace {

using json = nlohmann::json;

// etcd's gateway writes int64 fields as JSON strings ("ID": "7587…"), and
// accepts either form.
int64_t json_i64(const json& object, const char* field) {
  auto it = object.find(field);
  if (it == object.end() || it->is_null()) return 0;
  if (it->is_string()) {
    try {
      return std::stoll(it->get<std::string>());
    } catch (...) {
      return 0;
    }
  }
  if (it->is_number_integer()) return it->get<int64_t>();
  return 0;
}

std::string b64(std::string_view s) {
  return base64_encode(ByteView(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

// The end of the key range holding every key that starts with `prefix`
// (clientv3's GetPrefix): the prefix with its last byte below 0xff increased.
std::string prefix_range_end(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    auto& c = reinterpret_cast<unsigned char&>(end.back());
    if (c < 0xff) {
      ++c;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

Result<EtcdKeyValue> decode_kv(const json& kv) {
  EtcdKeyValue out;
  auto key = base64_decode(kv.value("key", std::string()));
  if (!key.ok()) {
    return err::ProtocolError("etcd answered a key that is not base64: " + key.status().message());
  }
  auto value = base64_decode(kv.value("value", std::string()));
  if (!value.ok()) {
    return err::ProtocolError("etcd answered a value that is not base64: " +
                              value.status().message());
  }
  out.key.assign(key->begin(), key->end());
  out.value = std::move(*value);
  out.lease = json_i64(kv, "lease");
  out.create_revision = json_i64(kv, "create_revision");
  return out;
}

// gRPC status codes, as the gateway reports them in "code".
Status map_grpc_error(int code, const std::string& text) {
  switch (code) {
    case 3:   // INVALID_ARGUMENT
    case 9:   // FAILED_PRECONDITION
    case 11:  // OUT_OF_RANGE
      return err::InvalidArgument(text);
    case 5:  // NOT_FOUND
      return err::NotFound(text);
    case 7:   // PERMISSION_DENIED
    case 16:  // UNAUTHENTICATED
      return err::PermissionDenied(text);
    case 4:  // DEADLINE_EXCEEDED
      return err::Timeout(text);
    case 8:   // RESOURCE_EXHAUSTED
    case 10:  // ABORTED
    case 14:  // UNAVAILABLE (no leader, shutting down)
      return err::Busy(text);
    case 12:  // UNIMPLEMENTED
      return err::NotSupported(text);
    default:
      return err::Internal(text);
  }
}

}  // namespace

struct EtcdClient::Response {
  long http_status = 0;
  std::string body;
};

EtcdClient::EtcdClient(EtcdClientOptions options) : options_(std::move(options)) {
  prefix_ = options_.gateway_prefix;
}

EtcdClient::~EtcdClient() = default;

std::string EtcdClient::endpoint() const {
  std::lock_guard lock(mu_);
  return options_.endpoints.empty() ? std::string() : options_.endpoints[current_];
}

Result<EtcdClient::Response> EtcdClient::perform(const std::string& endpoint,
                                                 const std::string& url, const std::string* body) {
  auto r = http_.request(endpoint, url, body, options_.connect_timeout, options_.request_timeout);
  if (!r.ok()) return r.status();
  return Response{r->status, std::move(r->body)};
}

Status EtcdClient::probe_one(const std::string& endpoint) {
  auto r = perform(endpoint, "http://" + endpoint + "/version", nullptr);
  if (!r.ok()) return r.status();
  const json j = json::parse(r->body, nullptr, false);
  if (r->http_status != 200 || j.is_discarded() || !j.is_object()) {
    return err::ProtocolError(fmt::format(
        "{} answered /version with HTTP {} and no etcd version: is it an etcd client URL?",
        endpoint, r->http_status));
  }
  server_version_ = j.value("etcdserver", std::string());
  std::string cluster = j.value("etcdcluster", std::string());
  if (cluster.empty() || cluster == "not_decided") cluster = server_version_;
  int major = 0, minor = 0;
  if (std::sscanf(cluster.c_str(), "%d.%d", &major, &minor) != 2) {
    return err::ProtocolError(
        fmt::format("etcd at {} reported an unreadable version '{}'", endpoint, cluster));
  }
  if (!options_.gateway_prefix.empty()) {
    prefix_ = options_.gateway_prefix;
  } else if (major > 3 || (major == 3 && minor >= 4)) {
    prefix_ = "/v3";  // 3.4 serves /v3 and /v3beta, 3.5+ /v3 only
  } else if (major == 3 && minor == 3) {
    prefix_ = "/v3beta";
  } else {
    return err::NotSupported(fmt::format(
        "etcd at {} is version {}; the directory needs etcd 3.3 or newer (its v3 HTTP gateway)",
        endpoint, cluster));
  }
  return Status::Ok();
}

Status EtcdClient::probe() {
  std::lock_guard lock(mu_);
  std::string failures;
  for (size_t i = 0; i < options_.endpoints.size(); ++i) {
    const size_t index = (current_ + i) % options_.endpoints.size();
    Status s = probe_one(options_.endpoints[index]);
    if (s.ok()) {
      current_ = index;
      return s;
    }
    if (s.code() != StatusCode::kPeerDisconnected && s.code() != StatusCode::kTimeout) return s;
    failures += (failures.empty() ? "" : "; ") + s.message();
  }
  return err::PeerDisconnected(fmt::format("no etcd endpoint answered ({}): {}",
                                           fmt::join(options_.endpoints, ", "), failures));
}

Result<std::string> EtcdClient::post(std::string_view path, const std::string& body,
                                     std::string_view what) {
  std::lock_guard lock(mu_);
  Status last;
  for (size_t i = 0; i < options_.endpoints.size(); ++i) {
    const size_t index = (current_ + i) % options_.endpoints.size();
    const std::string& endpoint = options_.endpoints[index];
    auto r = perform(endpoint, fmt::format("http://{}{}{}", endpoint, prefix_, path), &body);
    if (!r.ok()) {
      last = Status(r.status().code(), fmt::format("{} ({})", r.status().message(), what));
      continue;  // the next endpoint, if any
    }
    current_ = index;
    if (r->http_status == 200) {
      // A streaming call (lease keep-alive) reports errors inside a 200.
      return std::move(r->body);
    }
    const json j = json::parse(r->body, nullptr, false);
    if (r->http_status == 404 && (j.is_discarded() || !j.contains("code"))) {
      return err::NotSupported(fmt::format(
          "etcd at {} has no gateway path {}{} (HTTP 404) for {}; set the gateway prefix", endpoint,
          prefix_, path, what));
    }
    const std::string message =
        j.is_object() ? j.value("message", j.value("error", r->body)) : r->body;
    const int code = j.is_object() ? j.value("code", 2) : 2;
    return map_grpc_error(code, fmt::format("etcd at {} refused {}: {} (HTTP {})", endpoint, what,
                                            message, r->http_status));
  }
  return last;
}

namespace {

Result<json> parse_body(const Result<std::string>& body, std::string_view endpoint,
                        std::string_view what) {
  if (!body.ok()) return body.status();
  json j = json::parse(body.value(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return err::ProtocolError(
        fmt::format("etcd at {} answered {} with something that is not JSON", endpoint, what));
  }
  // Streaming calls wrap errors: {"error": {"grpc_code": 5, "message": "..."}}.
  if (auto e = j.find("error"); e != j.end() && e->is_object()) {
    return map_grpc_error(e->value("grpc_code", 2),
                          fmt::format("etcd at {} refused {}: {}", endpoint, what,
                                      e->value("message", std::string("unknown error"))));
  }
  return j;
}

}  // namespace

Result<nlohmann::json> EtcdClient::call(std::string_view path, const std::string& body,
                                        std::string_view what) {
  auto answer = post(path, body, what);
  return parse_body(answer, endpoint(), what);
}

Result<std::optional<EtcdKeyValue>> EtcdClient::get(std::string_view key) {
  const std::string what = fmt::format("range of key {}", key);
  json body = {{"key", b64(key)}};
  auto j = call("/kv/range", body.dump(), what);
  if (!j.ok()) return j.status();
  auto kvs = j->find("kvs");
  if (kvs == j->end() || !kvs->is_array() || kvs->empty()) {
    return std::optional<EtcdKeyValue>();
  }
  auto kv = decode_kv(kvs->front());
  if (!kv.ok()) return kv.status();
  return std::optional<EtcdKeyValue>(std::move(kv.value()));
}

Result<std::vector<EtcdKeyValue>> EtcdClient::get_prefix(std::string_view key_prefix,
                                                         bool keys_only) {
  const std::string what = fmt::format("range of prefix {}", key_prefix);
  json body = {{"key", b64(key_prefix)},
               {"range_end", b64(prefix_range_end(key_prefix))},
               {"keys_only", keys_only},
               {"sort_order", "ASCEND"},
               {"sort_target", "KEY"}};
  auto j = call("/kv/range", body.dump(), what);
  if (!j.ok()) return j.status();
  std::vector<EtcdKeyValue> out;
  if (auto kvs = j->find("kvs"); kvs != j->end() && kvs->is_array()) {
    for (const auto& item : *kvs) {
      auto kv = decode_kv(item);
      if (!kv.ok()) return kv.status();
      out.push_back(std::move(kv.value()));
    }
  }
  return out;
}

Status EtcdClient::put(std::string_view key, ByteView value, int64_t lease) {
  const std::string what = fmt::format("put of key {}", key);
  json body = {{"key", b64(key)}, {"value", base64_encode(value)}};
  if (lease) body["lease"] = std::to_string(lease);
  return call("/kv/put", body.dump(), what).status();
}

Result<EtcdClaim> EtcdClient::create_if_absent(
    std::string_view guard, const std::vector<std::pair<std::string, Bytes>>& puts, int64_t lease,
    std::string_view also_read) {
  const std::string what = fmt::format("create-if-absent transaction on key {}", guard);
  json success = json::array();
  for (const auto& [key, value] : puts) {
    json put = {{"key", b64(key)}, {"value", base64_encode(value)}};
    if (lease) put["lease"] = std::to_string(lease);
    success.push_back({{"request_put", put}});
  }
  json body = {{"compare", json::array({{{"key", b64(guard)},
                                         {"target", "CREATE"},
                                         {"result", "EQUAL"},
                                         {"create_revision", "0"}}})},
               {"success", success},
               {"failure", json::array({{{"request_range", {{"key", b64(guard)}}}},
                                        {{"request_range", {{"key", b64(also_read)}}}}})}};
  auto j = call("/kv/txn", body.dump(), what);
  if (!j.ok()) return j.status();
  EtcdClaim claim;
  claim.created = j->value("succeeded", false);
  if (claim.created) return claim;
  auto responses = j->find("responses");
  if (responses == j->end() || !responses->is_array() || responses->size() != 2) {
    return err::ProtocolError(
        fmt::format("etcd at {} answered {} without its two range responses", endpoint(), what));
  }
  for (size_t i = 0; i < 2; ++i) {
    const json& range = (*responses)[i].value("response_range", json::object());
    auto kvs = range.find("kvs");
    if (kvs == range.end() || !kvs->is_array() || kvs->empty()) continue;
    auto kv = decode_kv(kvs->front());
    if (!kv.ok()) return kv.status();
    (i == 0 ? claim.existing : claim.also_read) = std::move(kv.value());
  }
  return claim;
}

Result<bool> EtcdClient::put_if_lease(std::string_view guard, std::string_view key, ByteView value,
                                      int64_t lease) {
  const std::string what = fmt::format("put of key {} under lease {:x}", key, lease);
  json body = {{"compare", json::array({{{"key", b64(guard)},
                                         {"target", "LEASE"},
                                         {"result", "EQUAL"},
                                         {"lease", std::to_string(lease)}}})},
               {"success", json::array({{{"request_put",
                                          {{"key", b64(key)},
                                           {"value", base64_encode(value)},
                                           {"lease", std::to_string(lease)}}}}})}};
  auto j = call("/kv/txn", body.dump(), what);
  if (!j.ok()) return j.status();
  return j->value("succeeded", false);
}

Result<bool> EtcdClient::delete_prefix_if_lease(std::string_view guard, std::string_view key_prefix,
                                                int64_t lease) {
  const std::string what = fmt::format("delete of prefix {}", key_prefix);
  json body = {{"compare", json::array({{{"key", b64(guard)},
                                         {"target", "LEASE"},
                                         {"result", "EQUAL"},
                                         {"lease", std::to_string(lease)}}})},
               {"success", json::array({{{"request_delete_range",
                                          {{"key", b64(key_prefix)},
                                           {"range_end", b64(prefix_range_end(key_prefix))}}}}})}};
  auto j = call("/kv/txn", body.dump(), what);
  if (!j.ok()) return j.status();
  return j->value("succeeded", false);
}

Result<int64_t> EtcdClient::lease_grant(int64_t ttl_seconds) {
  const std::string what = fmt::format("grant of a {} s lease", ttl_seconds);
  json body = {{"TTL", std::to_string(ttl_seconds)}};
  auto j = call("/lease/grant", body.dump(), what);
  if (!j.ok()) return j.status();
  if (auto e = j->find("error");
      e != j->end() && e->is_string() && !e->get<std::string>().empty()) {
    return err::Internal(
        fmt::format("etcd at {} refused {}: {}", endpoint(), what, e->get<std::string>()));
  }
  const int64_t id = json_i64(*j, "ID");
  if (id == 0) {
    return err::ProtocolError(
        fmt::format("etcd at {} answered {} without a lease id", endpoint(), what));
  }
  return id;
}

Result<int64_t> EtcdClient::lease_keepalive(int64_t lease) {
  const std::string what = fmt::format("keep-alive of lease {:x}", lease);
  json body = {{"ID", std::to_string(lease)}};
  auto j = call("/lease/keepalive", body.dump(), what);
  if (!j.ok()) return j.status();
  // {"result": {"ID": ..., "TTL": "10"}}; TTL left out (0) when the lease is gone.
  auto result = j->find("result");
  if (result == j->end() || !result->is_object()) {
    return err::ProtocolError(
        fmt::format("etcd at {} answered {} without a result", endpoint(), what));
  }
  return json_i64(*result, "TTL");
}

Result<int64_t> EtcdClient::lease_time_to_live(int64_t lease) {
  const std::string what = fmt::format("time-to-live of lease {:x}", lease);
  json body = {{"ID", std::to_string(lease)}};
  // 3.4+ serves /lease/timetolive; 3.3 only /kv/lease/timetolive.
  const char* path = prefix_ == "/v3beta" ? "/kv/lease/timetolive" : "/lease/timetolive";
  auto j = call(path, body.dump(), what);
  if (!j.ok()) return j.status();
  return j->contains("TTL") ? json_i64(*j, "TTL") : -1;
}

Status EtcdClient::lease_revoke(int64_t lease) {
  const std::string what = fmt::format("revoke of lease {:x}", lease);
  json body = {{"ID", std::to_string(lease)}};
  const char* path = prefix_ == "/v3beta" ? "/kv/lease/revoke" : "/lease/revoke";
  return call(path, body.dump(), what).status();
}

}  // namespace ferry::directory
