// Engine: validates requests, owns the registry, the transfer table and the
// notification queue, and routes work to the transport chosen per peer.
#include "ferry/engine.h"

#include <sodium.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>

#include "core/metadata.h"
#include "core/options.h"
#include "core/region_registry.h"
#include "core/transfer.h"
#include "core/version.h"
#include "cuda/cuda_detect.h"
#include "fmt/format.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"
#include "transport/transport.h"

namespace ferry {
namespace {

constexpr size_t kMaxIovsPerCall = 1'000'000;
// wait() spins (engine.wait_spin_us) only on transfers of at most this many bytes.
constexpr uint64_t kSpinMaxBytes = 256 << 10;

const OptionSpec kEngineOptionSpecs[] = {
    {"engine.transport", OptionType::kString, "tcp",
     "network transport used for peers (registered: tcp)"},
    {"engine.log_level", OptionType::kString, "warn",
     "log level: trace, debug, info, warn, error, off"},
    {"engine.wait_spin_us", OptionType::kUint, "100",
     "wait() on a transfer of up to 256 KiB spins this long before sleeping (0: sleep at once)", 0,
     100000},
};

std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

std::vector<OptionSpec> all_option_specs() {
  std::vector<OptionSpec> specs(std::begin(kEngineOptionSpecs), std::end(kEngineOptionSpecs));
  for (const auto& t : registered_transports()) {
    specs.insert(specs.end(), t.options.begin(), t.options.end());
  }
  return specs;
}

// spdlog's default logger writes to stdout, which belongs to the application
// (ferry-bench --json, a user's own output). Log to stderr instead, unless the
// application installed a logger of its own.
void log_to_stderr() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto current = spdlog::default_logger();
    if (current && !current->name().empty()) return;  // the application's choice
    auto logger = spdlog::get("ferry");
    if (!logger) logger = spdlog::stderr_color_mt("ferry");
    spdlog::set_default_logger(logger);
  });
}

}  // namespace

class Engine::Impl : public TransportEvents {
 public:
  Status init(const EngineConfig& config) {
    auto options = OptionSet::resolve(all_option_specs(), config.options);
    if (!options.ok()) return options.status();
    options_ = std::move(options.value());
    const std::string& level = options_.get_string("engine.log_level");
    const auto parsed = spdlog::level::from_str(level);
    if (parsed == spdlog::level::off && level != "off") {
      return err::InvalidArgument(
          fmt::format("option engine.log_level: unknown level '{}'", level));
    }
    log_to_stderr();
    wait_spin_ = std::chrono::microseconds(options_.get_uint("engine.wait_spin_us"));
    spdlog::set_level(parsed);
    if (sodium_init() < 0) return err::Internal("libsodium failed to initialise");
    // register_memory tells GPU memory from host memory (host-only without CUDA).
    set_memory_kind_detector(&cuda_detect_memory_kind);
    do {
      randombytes_buf(&id_, sizeof id_);
    } while (id_ == 0);

    const std::string& name = options_.get_string("engine.transport");
    const TransportRegistration* reg = find_transport(name);
    if (!reg) {
      return err::InvalidArgument(fmt::format("option engine.transport: no transport '{}'", name));
    }
    network_ = reg->create();
    TransportContext ctx;
    ctx.engine_id = id_;
    ctx.listen = config.listen;
    ctx.registry = &registry_;
    ctx.events = this;
    ctx.options = &options_;
    if (Status s = network_->start(ctx); !s.ok()) return s;
    spdlog::info("ferry: engine {} up, transport {} at {}", hex_id(id_), name,
                 network_->local_address_text());
    return Status::Ok();
  }

  ~Impl() override {
    if (network_) network_->shutdown(err::Cancelled("engine shut down"));
    transfers_.fail_all(err::Cancelled("engine shut down"));
  }

  // --- TransportEvents ---
  void on_notification(PeerId peer, Bytes payload) override {
    {
      std::lock_guard lock(notify_mu_);
      notifications_.push_back({peer, std::move(payload)});
    }
    notify_cv_.notify_all();
  }
  void on_peer_up(PeerId peer) override {
    std::lock_guard lock(peers_mu_);
    lost_.erase(peer);
    known_.insert(peer);
  }
  std::vector<PeerId> known_peers() {
    std::lock_guard lock(peers_mu_);
    return {known_.begin(), known_.end()};
  }
  void on_peer_down(PeerId peer, const Status& reason) override {
    std::lock_guard lock(peers_mu_);
    lost_[peer] = reason.message();
  }

  Status check_peer(PeerId peer) {
    if (network_->is_connected(peer)) return Status::Ok();
    std::lock_guard lock(peers_mu_);
    if (auto it = lost_.find(peer); it != lost_.end()) {
      return err::PeerDisconnected(
          fmt::format("peer {} is disconnected ({}); connect again", hex_id(peer), it->second));
    }
    return err::NotFound(fmt::format(
        "peer {} is not connected: call connect() with its metadata first", hex_id(peer)));
  }

  // Local checks of one batch; fills the segments handed to the transport.
  Status build_segments(PeerId peer, std::span<const LocalIov> local,
                        std::span<const RemoteIov> remote, uint8_t wanted,
                        std::vector<Segment>* out) {
    const char* op = wanted == kAccessWrite ? "write" : "read";
    if (local.size() != remote.size()) {
      return err::InvalidArgument(
          fmt::format("{}: {} local iovs but {} remote iovs", op, local.size(), remote.size()));
    }
    if (local.empty() || local.size() > kMaxIovsPerCall) {
      return err::InvalidArgument(
          fmt::format("{}: {} iovs (allowed 1 to {})", op, local.size(), kMaxIovsPerCall));
    }
    out->resize(local.size());
    MemoryRegion cached{};
    for (size_t i = 0; i < local.size(); ++i) {
      const LocalIov& l = local[i];
      const RemoteIov& r = remote[i];
      if (l.length != r.length || l.length == 0) {
        return err::InvalidArgument(fmt::format(
            "{} iov {}: local length {} and remote length {} must be equal and non-zero", op, i,
            l.length, r.length));
      }
      const RemoteDescriptor* d = r.descriptor;
      if (d == nullptr) return err::InvalidArgument(fmt::format("{} iov {}: no descriptor", op, i));
      if (d->engine_id != peer) {
        return err::InvalidArgument(
            fmt::format("{} iov {}: descriptor of region {} belongs to engine {}, not to peer {}",
                        op, i, d->region_id, hex_id(d->engine_id), hex_id(peer)));
      }
      if (r.offset > d->length || r.length > d->length - r.offset) {
        return err::OutOfRange(
            fmt::format("{} iov {}: remote [{}, +{}) is outside the {} bytes advertised for region "
                        "{} of peer {}",
                        op, i, r.offset, r.length, d->length, d->region_id, hex_id(peer)));
      }
      if ((d->access & wanted) != wanted) {
        return err::PermissionDenied(
            fmt::format("{} iov {}: region {} of peer {} was advertised for {} access", op, i,
                        d->region_id, hex_id(peer), access_name(d->access)));
      }
      const auto a = reinterpret_cast<uintptr_t>(l.address);
      const auto base = reinterpret_cast<uintptr_t>(cached.address);
      if (cached.length == 0 || a < base || a - base > cached.length ||
          l.length > cached.length - (a - base)) {
        auto found = registry_.find_local(l.address, l.length);
        if (!found.ok()) {
          return Status(found.status().code(),
                        fmt::format("{} iov {}: {}", op, i, found.status().message()));
        }
        cached = *found;
      }
      if ((cached.kind != MemoryKind::kHost || d->kind != MemoryKind::kHost) &&
          !network_->capabilities().cuda_memory) {
        return err::NotSupported(fmt::format(
            "{} iov {}: GPU memory (local {}, remote {}) is not supported by the {} transport here",
            op, i, memory_kind_name(cached.kind), memory_kind_name(d->kind), network_->name()));
      }
      Segment& s = (*out)[i];
      s.local = static_cast<uint8_t*>(l.address);
      s.length = l.length;
      s.remote = {d->region_id, d->region_offset, d->length, d->key, d->access, r.offset, r.length};
      s.local_device = cached.kind == MemoryKind::kCuda ? cached.device : -1;
      s.remote_device = d->kind == MemoryKind::kCuda ? std::max(d->device, 0) : -1;
    }
    return Status::Ok();
  }

  Result<TransferId> post(TransferOp op, PeerId peer, std::span<const LocalIov> local,
                          std::span<const RemoteIov> remote, std::optional<ByteView> notification) {
    if (Status s = check_peer(peer); !s.ok()) return s;
    std::vector<Segment> segments;
    const uint8_t wanted = op == TransferOp::kWrite ? kAccessWrite : kAccessRead;
    if (Status s = build_segments(peer, local, remote, wanted, &segments); !s.ok()) return s;
    auto t = transfers_.create(op, peer);
    for (const Segment& seg : segments) t->bytes += seg.length;
    if (notification) {
      t->notification.assign(notification->begin(), notification->end());
      t->has_notification = true;
    }
    Status s = op == TransferOp::kWrite ? network_->post_write(peer, t, std::move(segments))
                                        : network_->post_read(peer, t, std::move(segments));
    if (!s.ok()) {
      network_->cancel(*t);
      transfers_.erase(t->id());
      return s;
    }
    return t->id();
  }

  Status wait(TransferId id, std::chrono::milliseconds timeout) {
    auto t = transfers_.find(id);
    if (!t) return unknown_transfer(id);
    // Spin only where it pays: a large transfer takes far longer than a
    // wake-up, and spinning would take a core from the I/O threads.
    const auto spin = t->bytes <= kSpinMaxBytes ? wait_spin_ : std::chrono::microseconds(0);
    if (!t->wait_until(std::chrono::steady_clock::now() + timeout, spin)) {
      return err::Timeout(
          fmt::format("transfer {} still in progress after {} ms", id, timeout.count()));
    }
    transfers_.erase(id);
    return t->status();
  }

  static Status unknown_transfer(TransferId id) {
    return err::NotFound(fmt::format(
        "transfer {} is unknown: never started, or its final status was already reported", id));
  }

  uint64_t id_ = 0;
  OptionSet options_;
  RegionRegistry registry_;
  TransferTable transfers_;
  std::unique_ptr<Transport> network_;
  std::mutex peers_mu_;
  std::map<PeerId, std::string> lost_;
  std::chrono::microseconds wait_spin_{0};
  std::set<PeerId> known_;
  std::mutex notify_mu_;
  std::condition_variable notify_cv_;
  std::deque<Notification> notifications_;
};

// ------------------------------------------------------------ public API ---

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::create(const EngineConfig& config) {
  auto impl = std::make_unique<Impl>();
  if (Status s = impl->init(config); !s.ok()) return s;
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

uint64_t Engine::id() const {
  return impl_->id_;
}

Bytes Engine::metadata() const {
  EngineMetadata m;
  m.engine_id = impl_->id_;
  m.protocol_version = kProtocolVersion;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  m.hostname = host;
  m.transports.push_back({std::string(impl_->network_->name()), impl_->network_->local_address()});
  return m.encode();
}

std::string Engine::listen_address() const {
  const std::string all = impl_->network_->local_address_text();
  return all.substr(0, all.find(','));
}

std::vector<OptionInfo> Engine::options() const {
  return impl_->options_.list();
}

Result<PeerId> Engine::connect(ByteView metadata) {
  auto m = EngineMetadata::decode(metadata);
  if (!m.ok()) return m.status();
  if (m->protocol_version != kProtocolVersion) {
    return err::ProtocolError(
        fmt::format("protocol version mismatch: engine {} on {} speaks {}, this engine speaks {}",
                    hex_id(m->engine_id), m->hostname, m->protocol_version, kProtocolVersion));
  }
  const auto* address = m->find(impl_->network_->name());
  if (!address) {
    return err::NotSupported(fmt::format("engine {} on {} offers no {} address",
                                         hex_id(m->engine_id), m->hostname,
                                         impl_->network_->name()));
  }
  return impl_->network_->connect(address->blob, m->engine_id);
}

Result<PeerId> Engine::connect(std::string_view host_port) {
  return impl_->network_->connect(
      ByteView(reinterpret_cast<const uint8_t*>(host_port.data()), host_port.size()), 0);
}

std::vector<PeerId> Engine::peers() const {
  // Peers that ever came up and are connected now.
  std::vector<PeerId> out;
  for (PeerId p : impl_->known_peers()) {
    if (impl_->network_->is_connected(p)) out.push_back(p);
  }
  return out;
}

Result<std::string> Engine::peer_address(PeerId peer) const {
  std::string address = impl_->network_->peer_address(peer);
  if (address.empty()) {
    return err::NotFound(fmt::format("peer {} is not connected", hex_id(peer)));
  }
  return address;
}

Result<MemoryRegion> Engine::register_memory(void* address, uint64_t length) {
  return impl_->registry_.add(address, length);
}

Status Engine::deregister_memory(RegionId region) {
  Transport* network = impl_->network_.get();
  return impl_->registry_.remove(region, [network] {
    if (network) network->release_revoked_regions();
  });
}

Result<RemoteDescriptor> Engine::advertise(RegionId region, uint64_t offset, uint64_t length,
                                           uint8_t access) const {
  return impl_->registry_.advertise(impl_->id_, region, offset, length, access);
}

Result<TransferId> Engine::write_async(PeerId peer, std::span<const LocalIov> local,
                                       std::span<const RemoteIov> remote,
                                       std::optional<ByteView> notification) {
  return impl_->post(TransferOp::kWrite, peer, local, remote, notification);
}

Result<TransferId> Engine::read_async(PeerId peer, std::span<const LocalIov> local,
                                      std::span<const RemoteIov> remote) {
  return impl_->post(TransferOp::kRead, peer, local, remote, std::nullopt);
}

namespace {
Status finish_blocking(Engine& e, Result<TransferId> id, std::chrono::milliseconds timeout) {
  if (!id.ok()) return id.status();
  Status s = e.wait(*id, timeout);
  if (s.code() == StatusCode::kTimeout) {
    // The caller gets control of its buffers back: stop the transfer first.
    (void)e.cancel(*id);
    (void)e.test(*id);
  }
  return s;
}
}  // namespace

Status Engine::write(PeerId peer, std::span<const LocalIov> local,
                     std::span<const RemoteIov> remote, std::optional<ByteView> notification,
                     std::chrono::milliseconds timeout) {
  return finish_blocking(*this, write_async(peer, local, remote, notification), timeout);
}

Status Engine::read(PeerId peer, std::span<const LocalIov> local, std::span<const RemoteIov> remote,
                    std::chrono::milliseconds timeout) {
  return finish_blocking(*this, read_async(peer, local, remote), timeout);
}

Status Engine::test(TransferId transfer) {
  auto t = impl_->transfers_.find(transfer);
  if (!t) return Impl::unknown_transfer(transfer);
  if (!t->finished()) return Status(StatusCode::kInProgress, "");
  impl_->transfers_.erase(transfer);
  return t->status();
}

Status Engine::wait(TransferId transfer, std::chrono::milliseconds timeout) {
  return impl_->wait(transfer, timeout);
}

Status Engine::cancel(TransferId transfer) {
  auto t = impl_->transfers_.find(transfer);
  if (!t) return Impl::unknown_transfer(transfer);
  if (t->finished()) return Status::Ok();
  impl_->network_->cancel(*t);
  t->complete(err::Cancelled(fmt::format("transfer {} was cancelled by the caller", transfer)));
  return Status::Ok();
}

Status Engine::notify(PeerId peer, ByteView payload) {
  if (Status s = impl_->check_peer(peer); !s.ok()) return s;
  auto t = impl_->transfers_.create(TransferOp::kNotify, peer);
  Status s = impl_->network_->post_notification(peer, t, Bytes(payload.begin(), payload.end()));
  if (!s.ok()) {
    impl_->transfers_.erase(t->id());
    return s;
  }
  return finish_blocking(*this, t->id(), std::chrono::seconds(30));
}

std::vector<Notification> Engine::take_notifications() {
  std::lock_guard lock(impl_->notify_mu_);
  std::vector<Notification> out(std::make_move_iterator(impl_->notifications_.begin()),
                                std::make_move_iterator(impl_->notifications_.end()));
  impl_->notifications_.clear();
  return out;
}

std::vector<Notification> Engine::wait_notifications(std::chrono::milliseconds timeout) {
  {
    std::unique_lock lock(impl_->notify_mu_);
    impl_->notify_cv_.wait_for(lock, timeout, [&] { return !impl_->notifications_.empty(); });
  }
  return take_notifications();
}

std::string_view version() {
  return kLibraryVersion;
}
uint16_t protocol_version() {
  return kProtocolVersion;
}

}  // namespace ferry
