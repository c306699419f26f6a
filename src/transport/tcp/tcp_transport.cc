// tcp transport: options, lifecycle and failure handling. Connection set-up
// (the handshake) is in tcp_connection.cc, posting and sending in
// tcp_datapath.cc, GPU staging in tcp_staging.cc, the I/O threads and
// receiving in tcp_progress.cc.
#include "transport/tcp/tcp_transport.h"

#include <unistd.h>

#include <algorithm>

#include "core/random_bytes.h"
#include "core/usable_cpus.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"

namespace ferry::tcp {

const OptionSpec kTcpOptionSpecs[] = {
    {"tcp.streams", OptionType::kUint, "0",
     "TCP connections (streams) per peer; frames are striped over them (0: one per I/O "
     "thread, at least 2)",
     0, 64},
    {"tcp.io_threads", OptionType::kUint, "0",
     "I/O threads (epoll loops) of the tcp transport (0: one per 4 CPUs this process may use, "
     "1 to 4)",
     0, 64},
    {"tcp.chunk_bytes", OptionType::kBytes, "1MiB",
     "largest payload of one frame: large iovs are cut into chunks of this size", 4096,
     64ull << 20},
    {"tcp.max_segments", OptionType::kUint, "256", "most iovs coalesced into one frame", 1,
     kMaxSegmentsPerFrame},
    {"tcp.connect_timeout_ms", OptionType::kDurationMs, "5000",
     "time allowed for connecting and the handshake", 1, 600000},
    {"tcp.user_timeout_ms", OptionType::kDurationMs, "10000",
     "TCP_USER_TIMEOUT: unacknowledged data for this long declares the peer dead", 100, 3600000},
    {"tcp.sndbuf", OptionType::kBytes, "0", "SO_SNDBUF per stream (0: kernel autotuning)", 0,
     1ull << 30},
    {"tcp.rcvbuf", OptionType::kBytes, "0", "SO_RCVBUF per stream (0: kernel autotuning)", 0,
     1ull << 30},
    {"tcp.gpu_staging_bytes", OptionType::kBytes, "64MiB",
     "pinned host memory for staging GPU data (1 MiB slots), allocated on first GPU transfer",
     2 << 20, 16ull << 30},
    {"tcp.gpu_sm_budget", OptionType::kUint, "4",
     "SMs the staging copy kernel may use for small pieces (0: copy engine only)", 0, 1024},
    {"tcp.gpu_inline_bytes", OptionType::kBytes, "64KiB",
     "staging copies of at most this many bytes run on the thread that has the frame, which "
     "waits for them (no hand-off to the GPU path's threads; 0: never). Larger ones overlap "
     "better on the GPU path's threads when several are in flight (docs/gpu.md)",
     0, 1 << 20},
    {"tcp.gpu_min_stripe_bytes", OptionType::kBytes, "32KiB",
     "a transfer touching GPU memory is striped over the streams in shares of at least this "
     "many bytes (host memory: 512 KiB), so that the frames' staging copies run in parallel, "
     "on both sides",
     4 << 10, 1 << 20},
    {"tcp.gpu_inline_wait_us", OptionType::kUint, "500",
     "longest an inline staging copy is waited for before its completion is handed to the "
     "GPU path's threads (a busy GPU must not hold an I/O thread)",
     1, 1000000},
    {"tcp.busy_poll_us", OptionType::kString, "auto",
     "after an I/O thread handled an event, how long (microseconds) it polls its sockets "
     "without sleeping before it blocks in epoll again: a sleeping thread wakes ~10-15 us late "
     "once idle for tens of microseconds, on each side of a round trip. Like tcp.serve_poll_us it "
     "stops for 20 ms on a crowded machine. auto: 500 where the process may use 8 CPUs or more, "
     "else 0 (never spin: the threads would take the cores the other side needs)"},
    {"tcp.serve_poll_us", OptionType::kString, "auto",
     "after an I/O thread began serving a peer's request, how long (microseconds) it polls its "
     "sockets without sleeping, so that the next request of a round trip finds it awake (the "
     "target's side; the initiator's caller spins in wait() itself). A thread that finds itself "
     "descheduled while polling, or more runnable threads than CPUs + 1 on the machine, sleeps "
     "between events for 20 ms. auto: 50 where the process may "
     "use fewer than 8 CPUs (there tcp.busy_poll_us is 0), else 0 (tcp.busy_poll_us covers it)"},
    {"tcp.handshake_revision", OptionType::kUint, "2",
     "highest handshake revision this engine offers and accepts: 2 carries both engines' "
     "metadata on a connection's first stream, so that connect by host:port reaches every "
     "transport the two engines share; 1 is the handshake of engines before it, for trying "
     "mixed versions (docs/protocol.md)",
     kHandshakeRevisionPlain, kHandshakeRevision},
    {"tcp.trace", OptionType::kBool, "false",
     "stage trace of every transfer this engine initiates (posted, staging copies, frames "
     "sent, the target's stages, response, completed; docs/trace.md); off costs one branch"},
    {"tcp.trace_keep", OptionType::kUint, "4096",
     "finished traced transfers kept for reading (the last N)", 1, 1u << 20},
};
const size_t kTcpOptionSpecCount = std::size(kTcpOptionSpecs);

namespace {
std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

// One I/O thread per 4 CPUs, 1 to 4. Every extra thread that has work costs
// wake-ups and context switches once threads outnumber cores: on a 2-core
// machine running both ends, 2 threads per engine (5 busy threads) did
// 2.2-2.8 context switches per 64 KiB write at depth 8, 1 thread 1.1-1.3,
// and 64 KiB went from 2.31 to 2.84 GB/s (medians of 3, docs/benchmarks.md).
uint32_t default_io_threads() {
  return static_cast<uint32_t>(std::clamp<uint32_t>(usable_cpus() / 4, 1, 4));
}

// A polling window: "auto" (`automatic`) or a count of microseconds.
Result<std::chrono::microseconds> parse_poll_us(const char* name, const std::string& v,
                                                std::chrono::microseconds automatic) {
  if (v == "auto") return automatic;
  char* end = nullptr;
  const unsigned long long us = std::strtoull(v.c_str(), &end, 10);
  if (v.empty() || end == v.c_str() || *end != 0 || v[0] == '-' || us > 1000000) {
    return err::InvalidArgument(
        fmt::format("option {}: '{}' is neither auto nor microseconds (0 to 1000000)", name, v));
  }
  return std::chrono::microseconds(us);
}

// tcp.busy_poll_us=auto: 500 us with 8 CPUs or more. An I/O thread serves
// every few transfers of a peer (the streams are spread over the workers), so
// it must keep spinning across several transfer times. With 200 us, blocking
// 4 KiB GPU->GPU writes (~40 us each, 4 workers) left gaps near the window: a
// worker that fell asleep woke 10-25 us late on each wire leg, which slowed the
// next transfers and so made more gaps -- p50 40 us in some runs, 64-111 us in
// others (H100). Below 8 CPUs, 0: pollers on both sides took the cores the
// caller and the peer needed (a 4 KiB round trip 42 -> 118 us on 2 CPUs).
std::chrono::microseconds auto_busy_poll() {
  return std::chrono::microseconds(usable_cpus() >= 8 ? 500 : 0);
}

// tcp.serve_poll_us=auto: below 8 CPUs only the target's side polls, after a
// request: there blocking 4 KiB writes between two network namespaces took
// 33 -> 14 us p50 on 2 CPUs (docs/benchmarks.md, "tcp: the target polls after
// serving a request"). With 8 or more, busy_poll covers every event.
std::chrono::microseconds auto_serve_poll() {
  return std::chrono::microseconds(usable_cpus() >= 8 ? 0 : 50);
}
}  // namespace

// ------------------------------------------------------------- lifecycle ---

TcpTransport::~TcpTransport() {
  shutdown(err::Cancelled("engine destroyed"));
}

Status TcpTransport::start(const TransportContext& context) {
  ctx_ = context;
  const OptionSet& o = *ctx_.options;
  opt_.streams = static_cast<uint32_t>(o.get_uint("tcp.streams"));
  opt_.io_threads = static_cast<uint32_t>(o.get_uint("tcp.io_threads"));
  if (opt_.io_threads == 0) opt_.io_threads = default_io_threads();
  auto busy_poll =
      parse_poll_us("tcp.busy_poll_us", o.get_string("tcp.busy_poll_us"), auto_busy_poll());
  if (!busy_poll.ok()) return busy_poll.status();
  opt_.busy_poll = *busy_poll;
  auto serve_poll =
      parse_poll_us("tcp.serve_poll_us", o.get_string("tcp.serve_poll_us"), auto_serve_poll());
  if (!serve_poll.ok()) return serve_poll.status();
  opt_.serve_poll = *serve_poll;
  // A stream's sends and receives are serial (one copy in the kernel at a
  // time), so a peer gets a stream per I/O thread: on a 16-core H100 host, 4
  // streams instead of 2 doubled 1 MiB reads (8.0 -> 14.6-15.9 GB/s host,
  // 6.5 -> 11-12 GB/s GPU memory).
  if (opt_.streams == 0) opt_.streams = std::max<uint32_t>(2, opt_.io_threads);
  opt_.chunk_bytes = o.get_uint("tcp.chunk_bytes");
  opt_.max_segments = static_cast<uint32_t>(o.get_uint("tcp.max_segments"));
  opt_.connect_timeout = std::chrono::milliseconds(o.get_uint("tcp.connect_timeout_ms"));
  opt_.user_timeout = std::chrono::milliseconds(o.get_uint("tcp.user_timeout_ms"));
  opt_.sndbuf = static_cast<int>(o.get_uint("tcp.sndbuf"));
  opt_.rcvbuf = static_cast<int>(o.get_uint("tcp.rcvbuf"));
  opt_.gpu_staging_bytes = o.get_uint("tcp.gpu_staging_bytes");
  opt_.gpu_sm_budget = static_cast<uint32_t>(o.get_uint("tcp.gpu_sm_budget"));
  opt_.gpu_inline_bytes = o.get_uint("tcp.gpu_inline_bytes");
  opt_.gpu_inline_wait = std::chrono::microseconds(o.get_uint("tcp.gpu_inline_wait_us"));
  opt_.gpu_min_stripe = o.get_uint("tcp.gpu_min_stripe_bytes");
  opt_.handshake_revision = static_cast<uint16_t>(o.get_uint("tcp.handshake_revision"));
  opt_.trace = o.get_bool("tcp.trace");
  opt_.trace_keep = o.get_uint("tcp.trace_keep");
  if (opt_.trace) trace_log_ = trace_log_for(ctx_.engine_id, opt_.trace_keep);
  // Thread names tell engines of one process apart: ferry0-io-0, ferry1-io-0...
  static std::atomic<int> engines_started{0};
  thread_prefix_ = fmt::format("ferry{}", engines_started.fetch_add(1));

  auto addresses = resolve(ctx_.listen);
  if (!addresses.ok()) return addresses.status();
  auto fd = listen_on(addresses->front(), &bound_);
  if (!fd.ok()) return fd.status();
  listen_fd_ = *fd;
  if (bound_.is_wildcard()) {
    for (const auto& a : interface_addresses(bound_.storage.ss_family, bound_.port())) {
      advertised_ += (advertised_.empty() ? "" : ",") + a.to_string();
    }
  }
  if (advertised_.empty()) advertised_ = bound_.to_string();

  for (uint32_t i = 0; i < opt_.io_threads; ++i) {
    workers_.push_back(std::make_unique<Worker>(*this, static_cast<int>(i)));
    if (auto s = workers_.back()->start(); !s.ok()) return s;
  }
  workers_.front()->watch_listener(listen_fd_);
  spdlog::debug("ferry tcp: engine {} listening on {} ({} streams/peer, {} io threads)",
                hex_id(ctx_.engine_id), advertised_, opt_.streams, opt_.io_threads);
  return Status::Ok();
}

void TcpTransport::shutdown(const Status& reason) {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  for (auto& w : workers_) w->stop();
  std::vector<std::shared_ptr<Group>> groups;
  {
    std::lock_guard lock(mu_);
    for (auto& [key, g] : groups_) groups.push_back(g);
    groups_.clear();
    primary_.clear();
  }
  for (auto& g : groups) {
    for (auto& s : g->streams) {
      if (!s) continue;
      fail_stream(*s, reason);
      close_stream(*s);
    }
  }
  workers_.clear();
  {
    std::lock_guard lock(gpu_mu_);
    gpu_.reset();  // waits for copies in flight; their callbacks find dead streams
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

TransportCaps TcpTransport::capabilities() const {
  TransportCaps caps;
  caps.cuda_memory = cuda_available();  // staged through pinned host memory
  return caps;
}

Result<GpuPath*> TcpTransport::gpu() {
  std::lock_guard lock(gpu_mu_);
  if (gpu_) return gpu_.get();
  if (!gpu_error_.ok()) return gpu_error_;
  auto created = GpuPath::create({opt_.gpu_staging_bytes, opt_.gpu_sm_budget, opt_.gpu_inline_bytes,
                                  opt_.gpu_inline_wait, kGpuFramePayload, "tcp"},
                                 thread_prefix_);
  if (!created.ok()) {
    gpu_error_ = created.status();
    return gpu_error_;
  }
  gpu_ = std::move(created.value());
  return gpu_.get();
}

Bytes TcpTransport::local_address() const {
  return Bytes(advertised_.begin(), advertised_.end());
}

std::shared_ptr<Group> TcpTransport::primary(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = primary_.find(peer);
  return it == primary_.end() ? nullptr : it->second;
}

bool TcpTransport::is_connected(PeerId peer) const {
  auto g = primary(peer);
  return g && !g->dead.load();
}

std::string TcpTransport::peer_address(PeerId peer) const {
  auto g = primary(peer);
  return g && !g->dead.load() ? g->remote : std::string();
}

std::string TcpTransport::peer_name(const Stream& s) const {
  auto g = s.group.lock();
  return g ? fmt::format("peer {} at {}", hex_id(g->peer), s.remote)
           : fmt::format("connection from {}", s.remote);
}

// --------------------------------------------------------------- failure ---

void TcpTransport::fail_transfer(Transfer& t, const Status& status) {
  // Taking io_mu waits out a receive into the caller's memory; after it no
  // more bytes land there, so the caller may free its buffers on failure.
  {
    std::lock_guard lock(t.io_mu);
    t.cancelled = true;
  }
  t.complete(status);
}

void TcpTransport::fail_stream(Stream& s, const Status& reason) {
  std::deque<std::unique_ptr<TxFrame>> frames;
  std::deque<std::shared_ptr<Pending>> pending;
  {
    std::lock_guard lock(s.tx_mu);
    if (s.dead.load()) return;
    s.dead.store(true);
    frames.swap(s.txq);
    pending.swap(s.pending);
    std::lock_guard g(s.def_mu);
    s.deferred.clear();
    if (!s.closed) ::shutdown(s.fd, SHUT_RDWR);
  }
  {
    // A GPU completion thread between its dead check and request_flush()
    // finishes before we go on (the worker may be destroyed after us).
    std::lock_guard g(s.def_mu);
  }
  auto group = s.group.lock();
  const std::string who = peer_name(s);
  const Status status(
      reason.code() == StatusCode::kProtocolError ? StatusCode::kPeerDisconnected : reason.code(),
      fmt::format("{}: connection lost: {}", who, reason.message()));
  // The group goes down before any transfer fails, so a caller that sees the
  // failure and retries at once finds the peer disconnected (not unknown).
  const bool first = group && !group->dead.exchange(true);
  if (first) {
    size_t in_flight = pending.size();
    for (auto& sibling : group->streams) {
      if (!sibling || sibling.get() == &s) continue;
      std::lock_guard lock(sibling->tx_mu);
      in_flight += sibling->pending.size();
    }
    if (reason.code() == StatusCode::kCancelled) {
      spdlog::debug("ferry tcp: {}", status.message());  // our own shutdown
    } else if (in_flight == 0 && reason.code() == StatusCode::kPeerDisconnected) {
      // A peer that went away with nothing in flight (it exited, say).
      spdlog::info("ferry tcp: {} (no operation was in flight)", status.message());
    } else if (in_flight == 0 && reason.code() == StatusCode::kProtocolError) {
      // Whoever found the bad input logged it (rate-limited): so is this.
      hostile_log_.log(spdlog::level::warn,
                       fmt::format("ferry tcp: {} (no operation was in flight)", status.message()));
    } else {
      spdlog::warn("ferry tcp: {} ({} operation(s) in flight fail)", status.message(), in_flight);
    }
    bool was_primary = false;
    {
      std::lock_guard lock(mu_);
      auto it = primary_.find(group->peer);
      if (it != primary_.end() && it->second == group) {
        primary_.erase(it);
        was_primary = true;
      }
      groups_.erase({group->peer, group->nonce});
    }
    if (was_primary) ctx_.events->on_peer_down(group->peer, status);
  }
  for (auto& f : frames) {
    if (f->started && f->transfer) f->transfer->tx_end();
  }
  for (auto& p : pending) {
    if (!p->dropped) fail_transfer(*p->transfer, status);
  }
  if (!first) return;
  for (auto& sibling : group->streams) {
    if (sibling && sibling.get() != &s) fail_stream(*sibling, reason);
  }
  // No fenced frame will be acknowledged now: requests held by the cancel
  // fence fail (the group is dead).
  {
    std::lock_guard lock(group->fence_mu);
    group->fenced = 0;
  }
  release_held(*group);
}

void TcpTransport::expire_handshake(Stream& s) {
  hostile_log_.log(spdlog::level::warn,
                   fmt::format("ferry tcp: closing connection from {}: no complete handshake "
                               "within {} ms (tcp.connect_timeout_ms)",
                               s.remote, opt_.connect_timeout.count()));
  fail_stream(s, err::Timeout("handshake timed out"));
  close_stream(s);
}

void TcpTransport::close_stream(Stream& s) {
  std::lock_guard lock(s.tx_mu);
  if (s.closed) return;
  s.closed = true;
  s.pins.clear();
  // Leave the epoll set explicitly: close() alone does not while another
  // reference to the socket lives on -- a child the application forks holds
  // one until its exec -- and the worker would then get events for a Stream
  // it has freed (seen under ASan in PeerFailure.InitiatorKilledLeavesTargetServing).
  if (s.worker != nullptr) s.worker->unwatch(s.fd);
  ::close(s.fd);
}

}  // namespace ferry::tcp
