// Engine: validates requests, owns the registry, the transfer table and the
// notification queue, and routes work to the transport chosen per peer.
#include "ferry/engine.h"

#include <unistd.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <optional>
#include <set>

#include "core/engine_options.h"
#include "core/host_identity.h"
#include "core/log_sink.h"
#include "core/lost_peers.h"
#include "core/metadata.h"
#include "core/notification_queue.h"
#include "core/options.h"
#include "core/peer_window.h"
#include "core/poll_yield.h"
#include "core/random_bytes.h"
#include "core/region_registry.h"
#include "core/transfer.h"
#include "core/transport_set.h"
#include "core/version.h"
#include "cuda/cuda_detect.h"
#include "ferry/directory.h"
#include "fmt/format.h"
#include "fmt/ranges.h"
#include "spdlog/spdlog.h"
#include "transport/transport.h"

namespace ferry {
namespace {

constexpr size_t kMaxIovsPerCall = 1'000'000;

std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

}  // namespace

// Forwards one transport's events to the engine, tagged with its name.
class TaggedEvents : public TransportEvents {
 public:
  TaggedEvents(Engine::Impl& impl, std::string_view transport)
      : impl_(impl), transport_(transport) {}
  void on_notification(PeerId peer, Bytes payload) override;
  void on_peer_up(PeerId peer) override;
  void on_peer_down(PeerId peer, const Status& reason) override;

 private:
  Engine::Impl& impl_;
  std::string transport_;
};

class Engine::Impl {
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
    wait_spin_max_bytes_ = options_.get_uint("engine.wait_spin_max_bytes");
    auto test_yield = parse_test_yield(options_.get_string("engine.test_yield"));
    if (!test_yield.ok()) return test_yield.status();
    test_yield_ = *test_yield;
    merge_iovs_ = options_.get_bool("engine.merge_iovs");
    windows_.configure(
        {options_.get_uint(kPeerWindowBytesOption), options_.get_uint(kPeerWindowIovsOption)});
    window_wait_ = std::chrono::milliseconds(options_.get_uint(kPeerWindowWaitOption));
    notifications_.set_max_bytes(options_.get_uint(kNotificationQueueBytesOption));
    auto gpu_path = parse_gpu_same_host_path(options_.get_string(kGpuSameHostPathOption));
    if (!gpu_path.ok()) return gpu_path.status();
    transports_.set_gpu_path(*gpu_path);
    spdlog::set_level(parsed);
    // register_memory tells GPU memory from host memory (host-only without CUDA).
    set_memory_kind_detector(&cuda_detect_memory_kind);
    auto id = random_nonzero_u64();
    if (!id.ok()) return err::Internal("engine id: " + id.status().message());
    id_ = *id;

    host_id_ = options_.get_string("engine.host_id");
    if (host_id_.empty()) host_id_ = kernel_boot_id();

    TransportContext ctx;
    ctx.engine_id = id_;
    ctx.listen = config.listen;
    ctx.registry = &registry_;
    ctx.options = &options_;
    // tcp's handshake carries both engines' metadata (connect by address).
    ctx.local_metadata = [this] {
      return metadata_ready_.load(std::memory_order_acquire) ? metadata_ : Bytes{};
    };
    ctx.peer_metadata = [this](PeerId peer, ByteView bytes) {
      return keep_handshake_metadata(peer, bytes);
    };
    Status s = transports_.start(
        options_.get_string("engine.transports"), ctx,
        [this](std::string_view name) { return std::make_unique<TaggedEvents>(*this, name); });
    if (!s.ok()) return s;
    for (const TransportInfo& t : transports_.describe()) {
      spdlog::info("ferry: engine {} transport {}: {}", hex_id(id_), t.name,
                   t.running ? "running at " + t.detail : "not running: " + t.detail);
    }
    metadata_ = build_metadata().encode();
    metadata_ready_.store(true, std::memory_order_release);
    return Status::Ok();
  }

  EngineMetadata build_metadata() const {
    EngineMetadata m;
    m.engine_id = id_;
    m.protocol_version = kProtocolVersion;
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    m.hostname = host;
    m.host_id = host_id_;
    for (const auto& t : transports_.running()) {
      m.transports.push_back({t.name, t.transport->local_address()});
    }
    return m;
  }

  // Metadata a peer sent in the tcp handshake: checked exactly as metadata
  // passed to connect() (check_peer_metadata), and it must name the engine
  // that sent it. Kept for connect(host:port), which then connects every
  // transport it lists (connect_listed).
  Status keep_handshake_metadata(PeerId peer, ByteView bytes) {
    auto m = decode_peer_metadata(bytes);
    if (!m.ok()) return m.status();
    if (m->engine_id != peer) {
      return err::InvalidArgument(
          fmt::format("it names engine {}, but the handshake comes from engine {}",
                      hex_id(m->engine_id), hex_id(peer)));
    }
    std::lock_guard lock(peers_mu_);
    if (handshake_metadata_.insert_or_assign(peer, std::move(m.value())).second) {
      handshake_metadata_order_.push_back(peer);
    }
    // Anyone who reaches the port can send metadata under ever new engine
    // ids (a group that never completes is not even a peer that goes away):
    // the oldest entries go first. connect(host:port) reads its entry right
    // after its own handshake.
    while (handshake_metadata_.size() > kMaxHandshakeMetadata) {
      handshake_metadata_.erase(handshake_metadata_order_.front());
      handshake_metadata_order_.pop_front();
    }
    return Status::Ok();
  }

  std::optional<EngineMetadata> handshake_metadata(PeerId peer) {
    std::lock_guard lock(peers_mu_);
    auto it = handshake_metadata_.find(peer);
    if (it == handshake_metadata_.end()) return std::nullopt;
    return it->second;
  }

  // Opens the directory and claims our name in it (after init: the metadata
  // lists the running transports).
  Status join_directory(const EngineConfig& config, Bytes metadata) {
    if (config.directory.empty() && config.name.empty()) return Status::Ok();
    if (config.directory.empty() || config.name.empty()) {
      return err::InvalidArgument(
          fmt::format("EngineConfig: directory '{}' and name '{}' go together: set both or neither",
                      config.directory, config.name));
    }
    if (Status s = validate_directory_name("engine name", config.name); !s.ok()) return s;
    auto dir = Directory::open(config.directory);
    if (!dir.ok()) return dir.status();
    if (Status s = (*dir)->publish_engine(config.name, metadata); !s.ok()) return s;
    directory_ = std::move(dir.value());
    name_ = config.name;
    spdlog::info("ferry: engine {} published as '{}' in {}", hex_id(id_), name_, config.directory);
    return Status::Ok();
  }

  Status need_directory(std::string_view what) const {
    if (directory_) return Status::Ok();
    return err::InvalidArgument(
        fmt::format("{}: this engine has no directory (EngineConfig::directory and name)", what));
  }

  ~Impl() {
    closing_.store(true);
    directory_.reset();  // our entries vanish first: nobody connects to us now
    transports_.shutdown(err::Cancelled("engine shut down"));
    transfers_.fail_all(err::Cancelled("engine shut down"));
  }

  // --- events from the transports ---
  void on_notification(PeerId peer, Bytes payload) {
    notifications_.push(peer, std::move(payload));
  }
  void on_peer_up(std::string_view transport, PeerId peer) {
    transports_.clear_unused(peer, transport);
    std::lock_guard lock(peers_mu_);
    lost_.came_back(peer);
    known_.insert(peer);
  }
  std::vector<PeerId> known_peers() {
    std::lock_guard lock(peers_mu_);
    return {known_.begin(), known_.end()};
  }
  void on_peer_down(std::string_view transport, PeerId peer, const Status& reason) {
    transports_.note_unused(peer, transport, fmt::format("connection lost: {}", reason.message()));
    if (!closing_.load() && transports_.connected(peer)) {
      // Another transport still reaches the peer: say so, never slow down
      // silently. A peer closing its connections as it exits is no news.
      const auto level = reason.code() == StatusCode::kPeerDisconnected ? spdlog::level::info
                                                                        : spdlog::level::warn;
      spdlog::log(level, "ferry: peer {}: {} connection lost ({}); its traffic moves to {}",
                  hex_id(peer), transport, reason.message(), describe_routes(peer));
    }
    std::vector<PeerId> forgotten;
    {
      // What is kept about peers that went away is bounded (LostPeers): a
      // call naming one forgotten gets NotFound instead of PeerDisconnected.
      std::lock_guard lock(peers_mu_);
      forgotten = lost_.lost(peer, reason.message());
      for (PeerId p : forgotten) known_.erase(p);
    }
    for (PeerId p : forgotten) transports_.forget(p);
  }

  // "host memory over shm, peer GPU memory over cuda_ipc, local GPU with
  // peer host memory over cuda_ipc" (tcp where cuda_ipc does not run)
  std::string describe_routes(PeerId peer) const {
    std::vector<std::string> parts;
    for (MemoryRoute route : kAllRoutes) {
      auto t = transports_.choose(peer, route);
      parts.push_back(
          fmt::format("{} over {}", memory_route_name(route),
                      t.ok() ? std::string((*t)->name()) : std::string("no transport")));
    }
    return fmt::format("{}", fmt::join(parts, ", "));
  }

  Status check_peer(PeerId peer) {
    if (transports_.connected(peer)) return Status::Ok();
    std::lock_guard lock(peers_mu_);
    if (const std::string* why = lost_.why(peer)) {
      return err::PeerDisconnected(
          fmt::format("peer {} is disconnected ({}); connect again", hex_id(peer), *why));
    }
    return err::NotFound(fmt::format(
        "peer {} is not connected: call connect() with its metadata first", hex_id(peer)));
  }

  // Local checks of one batch; fills the segments handed to the transport.
  Status build_segments(PeerId peer, std::span<const LocalIov> local,
                        std::span<const RemoteIov> remote, uint8_t wanted,
                        std::vector<Segment>* out, MemoryRoute* route, bool* host_pairs,
                        bool* peer_gpu) {
    const char* op = wanted == kAccessWrite ? "write" : "read";
    if (local.size() != remote.size()) {
      return err::InvalidArgument(
          fmt::format("{}: {} local iovs but {} remote iovs", op, local.size(), remote.size()));
    }
    if (local.empty() || local.size() > kMaxIovsPerCall) {
      return err::InvalidArgument(
          fmt::format("{}: {} iovs (allowed 1 to {})", op, local.size(), kMaxIovsPerCall));
    }
    // Reserved, not sized: merged iovs leave fewer segments than iovs, and a
    // sized vector would write every segment twice.
    out->clear();
    out->reserve(local.size());
    bool any_gpu = false;
    bool all_peer_gpu = true;
    *host_pairs = false;  // an iov with no GPU memory on either side
    *peer_gpu = false;    // an iov with GPU memory on the peer's side
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
      bool same_region = true;  // as the iov before (the local side)
      if (cached.length == 0 || a < base || a - base > cached.length ||
          l.length > cached.length - (a - base)) {
        same_region = false;
        auto found = registry_.find_local(l.address, l.length);
        if (!found.ok()) {
          return Status(found.status().code(),
                        fmt::format("{} iov {}: {}", op, i, found.status().message()));
        }
        cached = *found;
      }
      any_gpu = any_gpu || cached.kind != MemoryKind::kHost || d->kind != MemoryKind::kHost;
      all_peer_gpu = all_peer_gpu && d->kind == MemoryKind::kCuda;
      *peer_gpu = *peer_gpu || d->kind == MemoryKind::kCuda;
      *host_pairs =
          *host_pairs || (cached.kind != MemoryKind::kCuda && d->kind != MemoryKind::kCuda);
      // An iov continuing the one before on both sides (consecutive pages of
      // one tensor) extends its segment: the transports' per-segment work
      // (grants, copy descriptors, frame entries) then runs once per run of
      // pages, not once per page. The checks above still ran for each iov.
      if (merge_iovs_ && same_region && !out->empty() && remote[i - 1].descriptor == d) {
        Segment& p = out->back();
        if (p.local + p.length == static_cast<uint8_t*>(l.address) &&
            p.remote.offset + p.remote.length == r.offset) {
          p.length += l.length;
          p.remote.length += l.length;
          continue;
        }
      }
      Segment& s = out->emplace_back();
      s.local = static_cast<uint8_t*>(l.address);
      s.length = l.length;
      s.remote = {d->region_id, d->region_offset, d->length, d->key, d->access, r.offset, r.length};
      s.local_device = cached.kind == MemoryKind::kCuda ? cached.device : -1;
      s.remote_device = d->kind == MemoryKind::kCuda ? std::max(d->device, 0) : -1;
    }
    *route = !any_gpu       ? MemoryRoute::kHostOnly
             : all_peer_gpu ? MemoryRoute::kPeerGpu
                            : MemoryRoute::kGpuToPeerHost;
    return Status::Ok();
  }

  // `window_wait`: how long to wait for room in the peer's window.
  // `fallback`: this is the call posted again after its first transport
  // refused it and withdrew from the route (cuda_ipc, whose driver would not
  // map the peer's memory).
  Result<TransferId> post(TransferOp op, PeerId peer, std::span<const LocalIov> local,
                          std::span<const RemoteIov> remote, std::optional<ByteView> notification,
                          std::chrono::milliseconds window_wait, bool fallback = false) {
    // An unconnected peer is the error reported first, whatever else is
    // wrong; it is looked at only when something failed, so a call to a
    // connected peer asks its transports once (choose), not twice.
    std::vector<Segment> segments;
    const uint8_t wanted = op == TransferOp::kWrite ? kAccessWrite : kAccessRead;
    MemoryRoute route;
    bool host_pairs = false;
    bool peer_gpu = false;
    if (Status s =
            build_segments(peer, local, remote, wanted, &segments, &route, &host_pairs, &peer_gpu);
        !s.ok()) {
      if (Status c = check_peer(peer); !c.ok()) return c;
      return s;
    }
    auto chosen = transports_.choose(peer, route, host_pairs, peer_gpu);
    if (!chosen.ok()) {
      if (Status c = check_peer(peer); !c.ok()) return c;
      return chosen.status();
    }
    Transport* transport = *chosen;
    uint64_t bytes = 0;
    for (const Segment& seg : segments) bytes += seg.length;
    const uint64_t window_bytes = bytes + (notification ? notification->size() : 0);
    if (Status w = windows_.acquire(peer, window_bytes, segments.size(),
                                    PeerWindows::Clock::now() + window_wait);
        !w.ok()) {
      return w;
    }
    auto t = transfers_.create(op, peer);
    t->transport = transport;
    t->bytes = bytes;
    t->hold_window(&windows_, window_bytes, segments.size());
    if (notification) {
      t->notification.assign(notification->begin(), notification->end());
      t->has_notification = true;
    }
    Status s = op == TransferOp::kWrite ? transport->post_write(peer, t, std::move(segments))
                                        : transport->post_read(peer, t, std::move(segments));
    if (!s.ok()) {
      transport->cancel(*t);
      t->release_window();
      transfers_.erase(t->id());
      if (!fallback && route != MemoryRoute::kHostOnly) {
        // A transport that found out only now that it cannot carry this
        // peer's GPU memory withdraws from the route: the next one takes the
        // call (nothing of it ran), and every later call goes there directly.
        auto next = transports_.choose(peer, route, host_pairs, peer_gpu);
        if (next.ok() && *next != transport) {
          spdlog::warn("ferry: {} to peer {}: {} refused ({}); {} carries it from now on",
                       memory_route_name(route), hex_id(peer), transport->name(), s.message(),
                       (*next)->name());
          return post(op, peer, local, remote, notification, window_wait, true);
        }
      }
      return s;
    }
    return t->id();
  }

  Status wait(TransferId id, std::chrono::milliseconds timeout) {
    bool taken = false;  // finished already: out of the table in the same lookup
    auto t = transfers_.find(id, &taken);
    if (!t) return unknown_transfer(id);
    // Spin only where it pays: a large host-memory transfer takes far longer
    // than a wake-up, and spinning would take a core from the I/O threads.
    const auto spin = t->bytes <= spin_max_bytes(*t) ? wait_spin_ : std::chrono::microseconds(0);
    if (!t->wait_for(timeout, spin)) {
      return err::Timeout(
          fmt::format("transfer {} still in progress after {} ms", id, timeout.count()));
    }
    if (!taken) transfers_.erase(id);
    return t->status();
  }

  uint64_t spin_max_bytes(const Transfer& t) const {
    if (wait_spin_max_bytes_ != 0) return wait_spin_max_bytes_;
    return t.transport != nullptr ? t.transport->wait_spin_max_bytes() : 256 << 10;
  }

  static Status unknown_transfer(TransferId id) {
    return err::NotFound(fmt::format(
        "transfer {} is unknown: never started, or its final status was already reported", id));
  }

  // Connects every transport both engines run that can work between them.
  Result<PeerId> connect(const EngineMetadata& m) {
    const PeerId peer = m.engine_id;
    const bool same_host = !host_id_.empty() && m.host_id == host_id_;
    Status first_error;
    bool any = false;
    for (const TransportSet::Running& t : transports_.running()) {
      const TransportAddress* address = m.find(t.name);
      if (!address) {
        transports_.note_unused(
            peer, t.name,
            fmt::format("engine {} on {} does not run {}", hex_id(peer), m.hostname, t.name));
        continue;
      }
      if (t.caps.same_host_only && !same_host) {
        transports_.note_unused(
            peer, t.name,
            fmt::format("engine {} is on another host ({}, host id '{}'; ours '{}')", hex_id(peer),
                        m.hostname, m.host_id, host_id_));
        continue;
      }
      if (t.transport->is_connected(peer)) {
        any = true;
        continue;
      }
      auto r = t.transport->connect(address->blob, peer);
      if (!r.ok()) {
        transports_.note_unused(peer, t.name, r.status().message());
        if (first_error.ok()) first_error = r.status();
        if (t.caps.same_host_only) {
          spdlog::warn("ferry: peer {} on this host: {} not used: {}", hex_id(peer), t.name,
                       r.status().message());
        }
        continue;
      }
      any = true;
    }
    if (!any) {
      if (!first_error.ok()) return first_error;
      return err::NotSupported(
          fmt::format("engine {} on {} runs no transport this engine can use (ours: {})",
                      hex_id(peer), m.hostname, running_names()));
    }
    spdlog::info("ferry: peer {} on {} ({}): {}", hex_id(peer), m.hostname,
                 same_host ? "this host" : "another host", describe_routes(peer));
    // Said once per connect: GPU memory staged through shared host memory,
    // and why (a fallback warns; a forced choice only informs).
    bool forced = false;
    if (std::string why = transports_.gpu_staging_reason(peer, &forced); !why.empty()) {
      spdlog::log(forced ? spdlog::level::info : spdlog::level::warn,
                  "ferry: peer {} on this host: GPU memory goes through shm's shared host memory "
                  "(two copy-engine copies) because {}",
                  hex_id(peer), why);
    }
    return peer;
  }

  std::string running_names() const {
    std::vector<std::string> names;
    for (const auto& t : transports_.running()) names.push_back(t.name);
    return fmt::format("{}", fmt::join(names, ", "));
  }

  uint64_t id_ = 0;
  std::unique_ptr<Directory> directory_;
  std::string name_;
  std::atomic<bool> closing_{false};
  std::string host_id_;
  OptionSet options_;
  RegionRegistry registry_;
  PeerWindows windows_;  // before transfers_: a transfer gives its room back as it completes
  std::chrono::milliseconds window_wait_{0};
  TransferTable transfers_;
  TransportSet transports_;
  std::mutex peers_mu_;
  LostPeers lost_;  // under peers_mu_
  std::chrono::microseconds wait_spin_{0};
  uint64_t wait_spin_max_bytes_ = 0;  // 0: the transport's wait_spin_max_bytes()
  bool test_yield_ = false;
  bool merge_iovs_ = true;
  std::set<PeerId> known_;
  std::map<PeerId, EngineMetadata> handshake_metadata_;  // under peers_mu_
  std::deque<PeerId> handshake_metadata_order_;          // insertion order, under peers_mu_
  static constexpr size_t kMaxHandshakeMetadata = 256;
  Bytes metadata_;  // ours, written once before metadata_ready_
  std::atomic<bool> metadata_ready_{false};
  NotificationQueue notifications_;
};

void TaggedEvents::on_notification(PeerId peer, Bytes payload) {
  impl_.on_notification(peer, std::move(payload));
}
void TaggedEvents::on_peer_up(PeerId peer) {
  impl_.on_peer_up(transport_, peer);
}
void TaggedEvents::on_peer_down(PeerId peer, const Status& reason) {
  impl_.on_peer_down(transport_, peer, reason);
}

// ------------------------------------------------------------ public API ---

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::create(const EngineConfig& config) {
  auto impl = std::make_unique<Impl>();
  if (Status s = impl->init(config); !s.ok()) return s;
  auto engine = std::unique_ptr<Engine>(new Engine(std::move(impl)));
  if (Status s = engine->impl_->join_directory(config, engine->metadata()); !s.ok()) return s;
  return engine;
}

uint64_t Engine::id() const {
  return impl_->id_;
}

Bytes Engine::metadata() const {
  return impl_->build_metadata().encode();
}

std::string Engine::listen_address() const {
  Transport* network = impl_->transports_.network();
  if (!network) return {};
  const std::string all = network->local_address_text();
  return all.substr(0, all.find(','));
}

std::vector<TransportInfo> Engine::transports() const {
  return impl_->transports_.describe();
}

std::vector<OptionInfo> Engine::options() const {
  return impl_->options_.list();
}

Result<PeerId> Engine::connect(ByteView metadata) {
  auto m = decode_peer_metadata(metadata);
  if (!m.ok()) return m.status();
  return impl_->connect(*m);
}

Result<PeerId> Engine::connect(std::string_view host_port, std::chrono::milliseconds wait) {
  if (impl_->directory_ && host_port.find(':') == std::string_view::npos) {
    auto meta = impl_->directory_->lookup_engine(host_port, wait);
    if (!meta.ok()) return meta.status();
    return connect(ByteView(*meta));
  }
  Transport* network = impl_->transports_.network();
  if (!network) {
    return err::NotSupported(fmt::format(
        "connect to {}: no network transport runs (engine.transports: {}); connect by metadata",
        host_port, impl_->running_names()));
  }
  auto peer = network->connect(
      ByteView(reinterpret_cast<const uint8_t*>(host_port.data()), host_port.size()), 0);
  if (!peer.ok()) return peer;
  // The handshake brought the peer's metadata (checked as connect(metadata)
  // checks it): every other transport the two engines share connects now,
  // as connect(metadata) would have.
  if (auto m = impl_->handshake_metadata(*peer)) return impl_->connect(*m);
  for (const auto& t : impl_->transports_.running()) {
    if (!t.transport->is_connected(*peer)) {
      impl_->transports_.note_unused(
          *peer, t.name,
          fmt::format("connected by host:port ({}) to an engine whose tcp handshake carries no "
                      "metadata (handshake revision 1: an engine from before revision 2, or "
                      "tcp.handshake_revision=1): connect with its metadata to use {}",
                      host_port, t.name));
    }
  }
  return peer;
}

const std::string& Engine::name() const {
  return impl_->name_;
}

Status Engine::publish(std::string_view key, const RemoteDescriptor& descriptor) {
  if (Status s = impl_->need_directory("publish"); !s.ok()) return s;
  if (descriptor.engine_id != impl_->id_) {
    return err::InvalidArgument(
        fmt::format("publish '{}': the descriptor belongs to engine {}, not to this engine {}", key,
                    hex_id(descriptor.engine_id), hex_id(impl_->id_)));
  }
  return publish_descriptor(*impl_->directory_, impl_->name_, key, descriptor);
}

Result<RemoteDescriptor> Engine::lookup(std::string_view name, std::string_view key,
                                        std::chrono::milliseconds wait) {
  if (Status s = impl_->need_directory("lookup"); !s.ok()) return s;
  return lookup_descriptor(*impl_->directory_, name, key, wait);
}

std::vector<PeerId> Engine::peers() const {
  // Peers that ever came up and are connected now.
  std::vector<PeerId> out;
  for (PeerId p : impl_->known_peers()) {
    if (impl_->transports_.connected(p)) out.push_back(p);
  }
  return out;
}

Result<std::string> Engine::peer_address(PeerId peer) const {
  // The network address when there is one (what callers print), else any.
  std::string address;
  if (Transport* network = impl_->transports_.network()) address = network->peer_address(peer);
  for (const auto& t : impl_->transports_.running()) {
    if (address.empty()) address = t.transport->peer_address(peer);
  }
  if (address.empty()) {
    return err::NotFound(fmt::format("peer {} is not connected", hex_id(peer)));
  }
  return address;
}

Result<std::vector<PeerTransportInfo>> Engine::peer_transports(PeerId peer) const {
  const auto known = impl_->known_peers();
  if (!impl_->transports_.connected(peer) &&
      std::find(known.begin(), known.end(), peer) == known.end()) {
    return err::NotFound(fmt::format("peer {} is unknown: never connected", hex_id(peer)));
  }
  return impl_->transports_.describe_peer(peer);
}

Result<MemoryRegion> Engine::register_memory(void* address, uint64_t length) {
  return impl_->registry_.add(address, length);
}

Status Engine::deregister_memory(RegionId region) {
  const TransportSet& set = impl_->transports_;
  return impl_->registry_.remove(region, [&set] {
    for (const auto& t : set.running()) t.transport->release_revoked_regions();
  });
}

Result<RemoteDescriptor> Engine::advertise(RegionId region, uint64_t offset, uint64_t length,
                                           uint8_t access) const {
  return impl_->registry_.advertise(impl_->id_, region, offset, length, access);
}

Result<TransferId> Engine::write_async(PeerId peer, std::span<const LocalIov> local,
                                       std::span<const RemoteIov> remote,
                                       std::optional<ByteView> notification) {
  return impl_->post(TransferOp::kWrite, peer, local, remote, notification, impl_->window_wait_);
}

Result<TransferId> Engine::read_async(PeerId peer, std::span<const LocalIov> local,
                                      std::span<const RemoteIov> remote) {
  return impl_->post(TransferOp::kRead, peer, local, remote, std::nullopt, impl_->window_wait_);
}

namespace {
// `posted_at`: the call's start; its timeout covers the wait for room in the
// peer's window too.
Status finish_blocking(Engine& e, Result<TransferId> id, std::chrono::milliseconds timeout,
                       std::chrono::steady_clock::time_point posted_at) {
  if (!id.ok()) return id.status();
  timeout -= std::min(timeout, std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::steady_clock::now() - posted_at));
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
  const auto start = std::chrono::steady_clock::now();
  return finish_blocking(
      *this, impl_->post(TransferOp::kWrite, peer, local, remote, notification, timeout), timeout,
      start);
}

Status Engine::read(PeerId peer, std::span<const LocalIov> local, std::span<const RemoteIov> remote,
                    std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  return finish_blocking(*this,
                         impl_->post(TransferOp::kRead, peer, local, remote, std::nullopt, timeout),
                         timeout, start);
}

Status Engine::test(TransferId transfer) {
  bool taken = false;
  auto t = impl_->transfers_.find(transfer, &taken);
  if (!t) return Impl::unknown_transfer(transfer);
  const bool small = t->bytes <= impl_->spin_max_bytes(*t);
  if (!taken && t->transport != nullptr && small) {
    // A caller that polls (NIXL's check_xfer_state loop) may read the
    // completion itself, as a spinning wait() does, instead of waiting for
    // a transport thread to be woken and hand it over.
    t->transport->test_progress(*t);
    if (t->finished()) t = impl_->transfers_.find(transfer, &taken);
    if (!t) return Impl::unknown_transfer(transfer);
  }
  if (!taken) {
    // A large transfer is copied by transport threads (on one host: the
    // peer's), and a caller that polls it in a loop would keep a core from
    // them where cores are few (core/poll_yield.h).
    if (!small && t->transport != nullptr && impl_->test_yield_) yield_to_copiers();
    return Status(StatusCode::kInProgress, "");
  }
  settle_after_yields();
  return t->status();
}

Status Engine::wait(TransferId transfer, std::chrono::milliseconds timeout) {
  return impl_->wait(transfer, timeout);
}

Status Engine::cancel(TransferId transfer) {
  auto t = impl_->transfers_.find(transfer);
  if (!t) return Impl::unknown_transfer(transfer);
  if (t->finished()) return Status::Ok();
  if (t->transport) t->transport->cancel(*t);
  t->complete(err::Cancelled(fmt::format("transfer {} was cancelled by the caller", transfer)));
  return Status::Ok();
}

Status Engine::notify(PeerId peer, ByteView payload) {
  if (Status s = impl_->check_peer(peer); !s.ok()) return s;
  auto chosen = impl_->transports_.choose(peer, MemoryRoute::kHostOnly);
  if (!chosen.ok()) return chosen.status();
  const auto start = std::chrono::steady_clock::now();
  if (Status w = impl_->windows_.acquire(peer, payload.size(), 1, start + impl_->window_wait_);
      !w.ok()) {
    return w;
  }
  auto t = impl_->transfers_.create(TransferOp::kNotify, peer);
  t->transport = *chosen;
  t->hold_window(&impl_->windows_, payload.size(), 1);
  Status s = (*chosen)->post_notification(peer, t, Bytes(payload.begin(), payload.end()));
  if (!s.ok()) {
    t->release_window();
    impl_->transfers_.erase(t->id());
    return s;
  }
  return finish_blocking(*this, t->id(), std::chrono::seconds(30), start);
}

std::vector<Notification> Engine::take_notifications() {
  return impl_->notifications_.take();
}

std::vector<Notification> Engine::wait_notifications(std::chrono::milliseconds timeout) {
  return impl_->notifications_.wait(timeout);
}

uint64_t Engine::dropped_notifications() const {
  return impl_->notifications_.dropped();
}

}  // namespace ferry
