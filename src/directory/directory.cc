// ferry::Directory over etcd: names claimed with create-if-absent
// transactions, every entry under one lease kept alive by a thread, and the
// lease granted anew and every entry put back after the store lost it.
//
// Key layout under the prefix P (docs/directory.md):
//   P/engines/<name>/metadata   engine.metadata()   (the name's claim)
//   P/engines/<name>/holder     "pid 4242 on host-a" (shown to a refused claimer)
//   P/engines/<name>/keys/<key> published bytes (descriptors)
#include "ferry/directory.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "core/thread_name.h"
#include "directory/etcd_client.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using directory::EtcdClient;
using directory::EtcdClientOptions;

constexpr size_t kMaxNameLength = 128;

bool name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

Bytes to_bytes(std::string_view s) {
  return Bytes(s.begin(), s.end());
}
std::string to_text(const Bytes& b) {
  return std::string(b.begin(), b.end());
}

std::string default_holder() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "unknown host");
  return fmt::format("pid {} on {}", getpid(), host);
}

struct ParsedUrl {
  std::vector<std::string> endpoints;
  std::string prefix;  // "/ferry"
};

Result<ParsedUrl> parse_url(std::string_view url) {
  constexpr std::string_view kScheme = "etcd://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    return err::InvalidArgument(
        fmt::format("directory URL '{}' is not etcd://host:port[,host:port...][/prefix]", url));
  }
  std::string_view rest = url.substr(kScheme.size());
  const size_t slash = rest.find('/');
  std::string_view hosts = rest.substr(0, slash);
  std::string_view path = slash == std::string_view::npos ? "" : rest.substr(slash + 1);
  ParsedUrl out;
  while (!hosts.empty()) {
    const size_t comma = hosts.find(',');
    std::string_view one = hosts.substr(0, comma);
    hosts = comma == std::string_view::npos ? "" : hosts.substr(comma + 1);
    const size_t colon = one.rfind(':');
    if (one.empty() || colon == std::string_view::npos || colon == 0 || colon + 1 == one.size() ||
        !std::all_of(one.begin() + colon + 1, one.end(),
                     [](char c) { return c >= '0' && c <= '9'; })) {
      return err::InvalidArgument(
          fmt::format("directory URL '{}': endpoint '{}' is not host:port", url, one));
    }
    out.endpoints.emplace_back(one);
  }
  if (out.endpoints.empty()) {
    return err::InvalidArgument(fmt::format("directory URL '{}' names no host:port", url));
  }
  while (!path.empty() && path.back() == '/') path.remove_suffix(1);
  if (path.empty()) path = "ferry";
  // Each segment of the prefix follows the rules of names.
  std::string_view segments = path;
  while (!segments.empty()) {
    const size_t s = segments.find('/');
    Status st = validate_directory_name("directory URL prefix segment", segments.substr(0, s));
    if (!st.ok())
      return err::InvalidArgument(fmt::format("directory URL '{}': {}", url, st.message()));
    segments = s == std::string_view::npos ? "" : segments.substr(s + 1);
  }
  out.prefix = "/" + std::string(path);
  return out;
}

}  // namespace

Status validate_directory_name(std::string_view what, std::string_view value) {
  if (value.empty()) return err::InvalidArgument(fmt::format("{} is empty", what));
  if (value.size() > kMaxNameLength) {
    return err::InvalidArgument(fmt::format("{} '{}…' is {} characters long; at most {}", what,
                                            value.substr(0, 32), value.size(), kMaxNameLength));
  }
  if (value == "." || value == "..") {
    return err::InvalidArgument(fmt::format("{} '{}' is not allowed", what, value));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    if (!name_char(value[i])) {
      const auto c = static_cast<unsigned char>(value[i]);
      return err::InvalidArgument(fmt::format(
          "{} '{}' has {} at position {}; only A-Z a-z 0-9 . _ - are allowed", what,
          std::all_of(value.begin(), value.end(), [](char x) { return x >= 0x20 && x < 0x7f; })
              ? std::string(value)
              : std::string("<binary>"),
          c >= 0x20 && c < 0x7f ? fmt::format("'{}'", value[i]) : fmt::format("byte 0x{:02x}", c),
          i));
    }
  }
  return Status::Ok();
}

class Directory::Impl {
 public:
  Impl(const ParsedUrl& url, const DirectoryOptions& options)
      : options_(options),
        prefix_(url.prefix),
        holder_(options.holder.empty() ? default_holder() : options.holder),
        user_(client_options(url, options)),
        keeper_client_(client_options(url, options)) {}

  ~Impl() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (keeper_.joinable()) keeper_.join();
    std::lock_guard lock(publish_mu_);
    if (lease_ != 0) {
      Status s = user_.lease_revoke(lease_);
      if (!s.ok()) spdlog::warn("ferry directory: {}", s.message());
    }
  }

  Status open() {
    Status s = user_.probe();
    if (!s.ok()) return s;
    // The keeper speaks to the endpoint that answered, with the same prefix.
    s = keeper_client_.probe();
    if (!s.ok()) return s;
    spdlog::debug("ferry directory: etcd {} at {} (gateway {}), prefix {}, lease ttl {} s",
                  user_.server_version(), user_.endpoint(), user_.gateway_prefix(), prefix_,
                  options_.lease_ttl.count());
    return Status::Ok();
  }

  std::string engine_dir(std::string_view name) const {
    return fmt::format("{}/engines/{}/", prefix_, name);
  }
  std::string metadata_key(std::string_view name) const { return engine_dir(name) + "metadata"; }
  std::string holder_key(std::string_view name) const { return engine_dir(name) + "holder"; }
  std::string entry_key(std::string_view name, std::string_view key) const {
    return engine_dir(name) + "keys/" + std::string(key);
  }
  std::string where() const {
    return fmt::format("etcd at {} (prefix {})", user_.endpoint(), prefix_);
  }

  Status publish_engine(std::string_view name, ByteView metadata) {
    if (Status s = validate_directory_name("engine name", name); !s.ok()) return s;
    std::lock_guard lock(publish_mu_);
    if (Status s = ensure_lease(); !s.ok()) return s;
    const auto deadline = Clock::now() + options_.claim_wait;
    for (;;) {
      auto claimed = claim(user_, name, metadata);
      if (!claimed.ok()) return claimed.status();
      if (claimed.value().empty()) break;
      if (Clock::now() + 200ms > deadline) {
        return err::PermissionDenied(fmt::format(
            "engine name '{}' is held by {} in {}{}; it is released when that engine gives it up "
            "or its lease expires",
            name, claimed.value(), where(),
            options_.claim_wait.count() > 0
                ? fmt::format(" (waited {} ms for it)", options_.claim_wait.count())
                : ""));
      }
      std::this_thread::sleep_for(200ms);
    }
    std::lock_guard state(mu_);
    engines_[std::string(name)] = Bytes(metadata.begin(), metadata.end());
    lost_.erase(std::string(name));
    return Status::Ok();
  }

  Status publish(std::string_view name, std::string_view key, ByteView value) {
    if (Status s = validate_directory_name("engine name", name); !s.ok()) return s;
    if (Status s = validate_directory_name("key", key); !s.ok()) return s;
    std::lock_guard lock(publish_mu_);
    {
      std::lock_guard state(mu_);
      if (auto it = lost_.find(std::string(name)); it != lost_.end()) {
        return err::PermissionDenied(fmt::format(
            "publish of key '{}' under engine name '{}': this directory lost the name ({})", key,
            name, it->second));
      }
      if (!engines_.count(std::string(name))) {
        return err::InvalidArgument(fmt::format(
            "publish of key '{}' under engine name '{}': this directory does not hold that name "
            "(publish_engine it first)",
            key, name));
      }
    }
    auto done = user_.put_if_lease(metadata_key(name), entry_key(name, key), value, lease_);
    if (!done.ok()) return done.status();
    if (!done.value()) {
      return err::PermissionDenied(fmt::format(
          "publish of key '{}' under engine name '{}' in {}: the name is no longer held by this "
          "directory's lease {:x} (lost while the store was unreachable?)",
          key, name, where(), lease_));
    }
    std::lock_guard state(mu_);
    entries_[{std::string(name), std::string(key)}] = Bytes(value.begin(), value.end());
    return Status::Ok();
  }

  Status unpublish_engine(std::string_view name) {
    if (Status s = validate_directory_name("engine name", name); !s.ok()) return s;
    std::lock_guard lock(publish_mu_);
    {
      std::lock_guard state(mu_);
      if (!engines_.erase(std::string(name))) {
        return err::NotFound(fmt::format("engine name '{}' is not held by this directory", name));
      }
      std::erase_if(entries_, [&](const auto& e) { return e.first.first == name; });
    }
    auto done = user_.delete_prefix_if_lease(metadata_key(name), engine_dir(name), lease_);
    return done.status();
  }

  Result<Bytes> lookup_key(const std::string& key, std::string_view what,
                           std::chrono::milliseconds wait) {
    const auto deadline = Clock::now() + wait;
    auto pause = 50ms;
    for (;;) {
      auto kv = user_.get(key);
      const bool retry_transport =
          !kv.ok() &&
          (kv.status().code() == StatusCode::kPeerDisconnected ||
           kv.status().code() == StatusCode::kTimeout || kv.status().code() == StatusCode::kBusy);
      if (kv.ok() && kv.value().has_value()) return std::move(kv.value()->value);
      if (!kv.ok() && !retry_transport) return kv.status();
      const auto now = Clock::now();
      if (now >= deadline) {
        if (!kv.ok()) return kv.status();
        if (wait.count() > 0) {
          return err::Timeout(fmt::format("no {} appeared in {} within {} ms (key {})", what,
                                          where(), wait.count(), key));
        }
        return err::NotFound(fmt::format("no {} in {} (key {})", what, where(), key));
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
      pause = std::min<std::chrono::milliseconds>(pause * 2, 500ms);
    }
  }

  Result<std::vector<std::string>> engines() {
    auto kvs = user_.get_prefix(prefix_ + "/engines/", /*keys_only=*/true);
    if (!kvs.ok()) return kvs.status();
    std::vector<std::string> names;
    const std::string head = prefix_ + "/engines/";
    for (const auto& kv : kvs.value()) {
      std::string_view k = kv.key;
      if (k.size() <= head.size() || !k.ends_with("/metadata")) continue;
      k = k.substr(head.size(), k.size() - head.size() - std::string_view("/metadata").size());
      if (k.find('/') == std::string_view::npos) names.emplace_back(k);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  Status health() const {
    std::lock_guard state(mu_);
    if (!health_.ok()) return health_;
    if (!lost_.empty()) {
      const auto& [name, why] = *lost_.begin();
      return err::PermissionDenied(fmt::format("engine name '{}' was lost: {}", name, why));
    }
    return Status::Ok();
  }

  std::string endpoint() const { return user_.endpoint(); }
  const std::string& prefix() const { return prefix_; }
  int64_t lease_id() const {
    std::lock_guard state(mu_);
    return lease_;
  }

 private:
  static EtcdClientOptions client_options(const ParsedUrl& url, const DirectoryOptions& o) {
    return EtcdClientOptions{url.endpoints, o.connect_timeout, o.request_timeout, o.gateway_prefix};
  }

  // Grants the lease on first use and starts the keep-alive thread.
  // Caller holds publish_mu_.
  Status ensure_lease() {
    {
      std::lock_guard state(mu_);
      if (lease_ != 0) return Status::Ok();
    }
    auto lease = user_.lease_grant(options_.lease_ttl.count());
    if (!lease.ok()) return lease.status();
    std::lock_guard state(mu_);
    lease_ = lease.value();
    if (!keeper_.joinable()) keeper_ = std::thread([this] { keep_alive(); });
    return Status::Ok();
  }

  // One create-if-absent claim of `name` under lease_. "" when this directory
  // holds the name now; else who does. Caller holds publish_mu_.
  Result<std::string> claim(EtcdClient& client, std::string_view name, ByteView metadata) {
    const std::string guard = metadata_key(name);
    std::vector<std::pair<std::string, Bytes>> puts = {
        {guard, Bytes(metadata.begin(), metadata.end())}, {holder_key(name), to_bytes(holder_)}};
    auto c = client.create_if_absent(guard, puts, lease_, holder_key(name));
    if (!c.ok()) return c.status();
    if (c->created) return std::string();
    const int64_t their_lease = c->existing ? c->existing->lease : 0;
    if (their_lease == lease_) {
      // Ours already: replace the metadata (the guard is held by our lease).
      auto put = client.put_if_lease(guard, guard, metadata, lease_);
      if (!put.ok()) return put.status();
      if (put.value()) return std::string();
    }
    std::string who = c->also_read ? to_text(c->also_read->value) : std::string("an engine");
    if (their_lease == 0) return who + " (with no lease: it never expires; delete the key)";
    auto ttl = client.lease_time_to_live(their_lease);
    if (ttl.ok() && ttl.value() >= 0) {
      return fmt::format("{} (lease {:x}, {} s left)", who, their_lease, ttl.value());
    }
    return fmt::format("{} (lease {:x})", who, their_lease);
  }

  // The keep-alive thread: refreshes the lease every ttl/3 (every 500 ms while
  // the store does not answer); if the store lost the lease, grants a new one
  // and puts every entry back.
  void keep_alive() {
    name_this_thread("ferry-directory");
    const auto period = std::max<std::chrono::milliseconds>(
        std::chrono::milliseconds(options_.lease_ttl) / 3, 200ms);
    bool healthy = true;
    for (;;) {
      {
        std::unique_lock state(mu_);
        cv_.wait_for(state, healthy ? period : std::min<std::chrono::milliseconds>(period, 500ms),
                     [&] { return stop_; });
        if (stop_) return;
      }
      const int64_t lease = lease_id();
      auto ttl = keeper_client_.lease_keepalive(lease);
      if (!ttl.ok()) {
        set_health(ttl.status(), healthy);
        healthy = false;
        continue;
      }
      if (ttl.value() > 0 && !restore_pending_) {
        if (!healthy) spdlog::info("ferry directory: lease {:x} renewed again", lease);
        set_health(Status::Ok(), healthy);
        healthy = true;
        continue;
      }
      // Lease gone: a new one. Lease alive but an earlier restore did not
      // finish: finish it under the lease that restore granted.
      Status s = restore(lease, /*new_lease=*/ttl.value() <= 0);
      set_health(s, healthy);
      healthy = s.ok();
    }
  }

  void set_health(const Status& s, bool was_healthy) {
    if (!s.ok() && was_healthy) {
      spdlog::warn("ferry directory: {}; retrying every 500 ms", s.message());
    }
    std::lock_guard state(mu_);
    if (s.ok()) {
      health_ = s;
    } else {
      health_ = Status(s.code(), fmt::format("{} (keep-alive of lease {:x} failing; lookups and "
                                             "publishing resume when the store answers)",
                                             s.message(), lease_));
    }
  }

  // The store no longer has lease `old`: grant a new one, claim every name
  // again and put every entry back. A name someone else took meanwhile is
  // lost (reported by health() and refused by publish()).
  Status restore(int64_t old, bool new_lease) {
    std::lock_guard lock(publish_mu_);
    restore_pending_ = true;
    Result<int64_t> lease = old;
    if (new_lease) lease = keeper_client_.lease_grant(options_.lease_ttl.count());
    if (!lease.ok()) return lease.status();
    std::map<std::string, Bytes> engines;
    std::map<std::pair<std::string, std::string>, Bytes> entries;
    {
      std::lock_guard state(mu_);
      lease_ = lease.value();
      engines = engines_;
      entries = entries_;
    }
    if (new_lease) {
      spdlog::warn(
          "ferry directory: the store lost lease {:x}; publishing {} name(s) again "
          "under lease {:x}",
          old, engines.size(), lease.value());
    }
    for (const auto& [name, metadata] : engines) {
      auto who = claim(keeper_client_, name, metadata);
      if (!who.ok()) return who.status();
      if (!who.value().empty()) {
        spdlog::error(
            "ferry directory: engine name '{}' was taken by {} while this directory's "
            "lease was lost",
            name, who.value());
        std::lock_guard state(mu_);
        engines_.erase(name);
        // clang 14 cannot capture a structured binding in a lambda: name it.
        const std::string& lost_name = name;
        std::erase_if(entries_, [&](const auto& e) { return e.first.first == lost_name; });
        lost_[name] = fmt::format("taken by {} while this directory's lease was lost", who.value());
        continue;
      }
      for (const auto& [k, value] : entries) {
        if (k.first != name) continue;
        auto put = keeper_client_.put_if_lease(metadata_key(name), entry_key(name, k.second), value,
                                               lease.value());
        if (!put.ok()) return put.status();
      }
    }
    restore_pending_ = false;
    return Status::Ok();
  }

  const DirectoryOptions options_;
  const std::string prefix_;
  const std::string holder_;
  EtcdClient user_;           // the caller's requests
  EtcdClient keeper_client_;  // the keep-alive thread's

  std::mutex publish_mu_;  // serializes changes of what is in the store
  mutable std::mutex mu_;  // the fields below
  std::condition_variable cv_;
  bool stop_ = false;
  int64_t lease_ = 0;
  std::map<std::string, Bytes> engines_;                          // held names → metadata
  std::map<std::pair<std::string, std::string>, Bytes> entries_;  // (name, key) → value
  std::map<std::string, std::string> lost_;                       // name → why
  Status health_;
  bool restore_pending_ = false;  // keeper thread only
  std::thread keeper_;
};

Result<std::unique_ptr<Directory>> Directory::open(std::string_view url,
                                                   const DirectoryOptions& options) {
  auto parsed = parse_url(url);
  if (!parsed.ok()) return parsed.status();
  if (options.lease_ttl.count() < 1) {
    return err::InvalidArgument(
        fmt::format("directory lease ttl {} s: at least 1 s", options.lease_ttl.count()));
  }
  if (options.request_timeout.count() < 1 || options.connect_timeout.count() < 1) {
    return err::InvalidArgument("directory timeouts must be at least 1 ms");
  }
  auto impl = std::make_unique<Impl>(parsed.value(), options);
  if (Status s = impl->open(); !s.ok()) return s;
  return std::unique_ptr<Directory>(new Directory(std::move(impl)));
}

Directory::Directory(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Directory::~Directory() = default;

Status Directory::publish_engine(std::string_view name, ByteView metadata) {
  return impl_->publish_engine(name, metadata);
}

Result<Bytes> Directory::lookup_engine(std::string_view name, std::chrono::milliseconds wait) {
  if (Status s = validate_directory_name("engine name", name); !s.ok()) return s;
  return impl_->lookup_key(impl_->metadata_key(name), fmt::format("engine named '{}'", name), wait);
}

Status Directory::publish(std::string_view name, std::string_view key, ByteView value) {
  return impl_->publish(name, key, value);
}

Result<Bytes> Directory::lookup(std::string_view name, std::string_view key,
                                std::chrono::milliseconds wait) {
  if (Status s = validate_directory_name("engine name", name); !s.ok()) return s;
  if (Status s = validate_directory_name("key", key); !s.ok()) return s;
  return impl_->lookup_key(impl_->entry_key(name, key),
                           fmt::format("key '{}' of engine '{}'", key, name), wait);
}

Status Directory::unpublish_engine(std::string_view name) {
  return impl_->unpublish_engine(name);
}
Result<std::vector<std::string>> Directory::engines() {
  return impl_->engines();
}
Status Directory::health() const {
  return impl_->health();
}
std::string Directory::endpoint() const {
  return impl_->endpoint();
}
std::string Directory::prefix() const {
  return impl_->prefix();
}
int64_t Directory::lease_id() const {
  return impl_->lease_id();
}

// --- engine helpers ---------------------------------------------------------

Result<PeerId> connect_by_name(Engine& engine, Directory& directory, std::string_view name,
                               std::chrono::milliseconds wait) {
  auto metadata = directory.lookup_engine(name, wait);
  if (!metadata.ok()) return metadata.status();
  auto peer = engine.connect(metadata.value());
  if (!peer.ok()) {
    return Status(peer.status().code(), fmt::format("engine '{}' (from the directory): {}", name,
                                                    peer.status().message()));
  }
  return peer;
}

Status publish_descriptor(Directory& directory, std::string_view name, std::string_view key,
                          const RemoteDescriptor& descriptor) {
  return directory.publish(name, key, descriptor.to_bytes());
}

Result<RemoteDescriptor> lookup_descriptor(Directory& directory, std::string_view name,
                                           std::string_view key, std::chrono::milliseconds wait) {
  auto bytes = directory.lookup(name, key, wait);
  if (!bytes.ok()) return bytes.status();
  auto descriptor = RemoteDescriptor::from_bytes(bytes.value());
  if (!descriptor.ok()) {
    return Status(descriptor.status().code(),
                  fmt::format("key '{}' of engine '{}' in the directory is not a descriptor: {}",
                              key, name, descriptor.status().message()));
  }
  return descriptor;
}

}  // namespace ferry
