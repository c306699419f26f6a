// tcp transport: lifecycle, workers and failure handling. Connection set-up
// (the handshake) is in tcp_connection.cc, the data path (frames, sending,
// receiving) in tcp_datapath.cc.
#include "transport/tcp/tcp_transport.h"

#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include "core/cpu_relax.h"
#include "core/random_bytes.h"
#include "core/thread_name.h"
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
     "once idle for tens of microseconds, on each side of a round trip. auto: 500 where the "
     "process may use 8 CPUs or more, else 0 (never spin: the threads would take the cores "
     "the other side needs)"},
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

// CPUs this process may run on.
long usable_cpus() {
  cpu_set_t set;
  long cpus = 0;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
  if (cpus <= 0) cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return cpus;
}

// One I/O thread per 4 CPUs, 1 to 4. Every extra thread that has work costs
// wake-ups and context switches once threads outnumber cores: on a 2-core
// machine running both ends, 2 threads per engine (5 busy threads) did
// 2.2-2.8 context switches per 64 KiB write at depth 8, 1 thread 1.1-1.3,
// and 64 KiB went from 2.31 to 2.84 GB/s (medians of 3, docs/benchmarks.md).
uint32_t default_io_threads() {
  return static_cast<uint32_t>(std::clamp<long>(usable_cpus() / 4, 1, 4));
}

// tcp.busy_poll_us: "auto" or a count of microseconds.
Result<std::chrono::microseconds> parse_busy_poll(const std::string& v) {
  // 500 us: an I/O thread serves every few transfers of a peer (the streams
  // are spread over the workers), so it must keep spinning across several
  // transfer times. With 200 us, blocking 4 KiB GPU->GPU writes (~40 us each,
  // 4 workers) left gaps near the window: a worker that fell asleep woke
  // 10-25 us late on each wire leg, which slowed the next transfers and so
  // made more gaps -- p50 40 us in some runs, 64-111 us in others (H100).
  if (v == "auto") return std::chrono::microseconds(usable_cpus() >= 8 ? 500 : 0);
  char* end = nullptr;
  const unsigned long long us = std::strtoull(v.c_str(), &end, 10);
  if (v.empty() || end == v.c_str() || *end != 0 || v[0] == '-' || us > 1000000) {
    return err::InvalidArgument("tcp.busy_poll_us=" + v +
                                ": expected auto or microseconds (0 to 1000000)");
  }
  return std::chrono::microseconds(us);
}
}  // namespace

// ----------------------------------------------------------------- Worker ---

Worker::Worker(TcpTransport& transport, int index)
    : transport_(transport), index_(index), discard_(64 * 1024) {}

Worker::~Worker() {
  stop();
  if (epfd_ >= 0) ::close(epfd_);
  if (wakefd_ >= 0) ::close(wakefd_);
}

Status Worker::start() {
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  wakefd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || wakefd_ < 0) return err::Internal("epoll/eventfd: " + errno_text(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = &wake_tag_;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, wakefd_, &ev);
  thread_ = std::thread([this] {
    name_this_thread(fmt::format("{}-io-{}", transport_.thread_prefix(), index_));
    run();
  });
  return Status::Ok();
}

void Worker::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  uint64_t one = 1;
  [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
  thread_.join();
  std::lock_guard lock(mu_);
  streams_.clear();
  flush_requests_.clear();
  resume_requests_.clear();
}

void Worker::adopt(const std::shared_ptr<Stream>& stream) {
  stream->worker = this;
  const bool handshaking = stream->handshaking();
  {
    std::lock_guard lock(mu_);
    streams_[stream.get()] = stream;
    // Under mu_, so expire_handshakes() (which recounts under mu_) cannot
    // overwrite this increment with a count taken before the stream arrived.
    if (handshaking) handshaking_.fetch_add(1);
  }
  if (handshaking) {
    // The loop may be asleep with no timeout: wake it to arm the check.
    uint64_t one = 1;
    [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = static_cast<EpollTag*>(stream.get());
  epoll_ctl(epfd_, EPOLL_CTL_ADD, stream->fd, &ev);
}

void Worker::request_flush(std::shared_ptr<Stream> stream) {
  {
    std::lock_guard lock(mu_);
    flush_requests_.push_back(std::move(stream));
  }
  uint64_t one = 1;
  [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
}

void Worker::request_resume(std::shared_ptr<Stream> stream, std::unique_ptr<StagingSlot> slot) {
  {
    std::lock_guard lock(mu_);
    resume_requests_.emplace_back(std::move(stream), std::move(slot));
  }
  uint64_t one = 1;
  [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
}

void Worker::request_release() {
  release_requested_.store(true);
  uint64_t one = 1;
  [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
}

void Worker::unwatch(int fd) {
  epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
}

void Worker::watch_listener(int fd) {
  listen_fd_ = fd;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = &listen_tag_;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev);
}

void Worker::want_writable(Stream& s, bool on) {
  if (s.want_out == on || s.closed) return;
  s.want_out = on;
  watch_events(s);
}

void Worker::pause_reading(Stream& s, bool paused) {
  if (s.rx_paused == paused || s.closed) return;
  s.rx_paused = paused;
  watch_events(s);
}

void Worker::watch_events(Stream& s) {
  epoll_event ev{};
  ev.events = (s.rx_paused ? 0u : static_cast<uint32_t>(EPOLLIN)) |
              (s.want_out ? static_cast<uint32_t>(EPOLLOUT) : 0u);
  ev.data.ptr = static_cast<EpollTag*>(&s);
  epoll_ctl(epfd_, EPOLL_CTL_MOD, s.fd, &ev);
}

void Worker::run() {
  epoll_event events[64];
  int timeout_ms = -1;
  auto next_handshake_check = std::chrono::steady_clock::time_point{};
  // Busy polling: for busy_poll after the last event, epoll is asked without
  // sleeping, so the next frame of a round trip finds the thread awake.
  const auto busy_poll = transport_.options().busy_poll;
  auto last_event = std::chrono::steady_clock::time_point{};
  while (!stop_.load(std::memory_order_relaxed)) {
    const bool spinning =
        busy_poll.count() > 0 && std::chrono::steady_clock::now() - last_event < busy_poll;
    const int n = epoll_wait(epfd_, events, 64, spinning ? 0 : timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("ferry tcp: epoll_wait failed in worker {}: {}", index_, errno_text(errno));
      return;
    }
    if (n > 0 && busy_poll.count() > 0) last_event = std::chrono::steady_clock::now();
    if (n == 0 && spinning && !handshaking_.load(std::memory_order_relaxed)) {
      cpu_relax();
      continue;
    }
    for (int i = 0; i < n; ++i) {
      auto* tag = static_cast<EpollTag*>(events[i].data.ptr);
      if (tag->kind == EpollTag::kWake) {
        uint64_t v;
        [[maybe_unused]] auto r = ::read(wakefd_, &v, sizeof v);
        continue;
      }
      if (tag->kind == EpollTag::kListener) {
        transport_.on_accept(listen_fd_);
        continue;
      }
      auto* s = static_cast<Stream*>(tag);
      if (s->closed) continue;
      if (events[i].events & EPOLLOUT) transport_.on_writable(*s);
      if (s->rx == Stream::Rx::kWaitSlot) {
        // Reading is paused; a broken connection must not wait for a slot.
        if (events[i].events & (EPOLLERR | EPOLLHUP)) transport_.on_broken_while_waiting(*s);
        continue;
      }
      if (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) transport_.on_readable(*s);
    }
    std::vector<std::shared_ptr<Stream>> to_flush;
    std::vector<std::pair<std::shared_ptr<Stream>, std::unique_ptr<StagingSlot>>> to_resume;
    {
      std::lock_guard lock(mu_);
      to_flush.swap(flush_requests_);
      to_resume.swap(resume_requests_);
    }
    for (auto& s : to_flush) {
      if (!s->closed) transport_.on_writable(*s);
    }
    for (auto& [s, slot] : to_resume) {
      if (!s->closed) transport_.resume_receive(*s, std::move(slot));
    }
    if (release_requested_.load(std::memory_order_relaxed) && release_requested_.exchange(false)) {
      std::vector<std::shared_ptr<Stream>> all;
      {
        std::lock_guard lock(mu_);
        for (auto& [p, s] : streams_) all.push_back(s);
      }
      for (auto& s : all) {
        if (!s->closed) transport_.release_revoked(*s);
      }
    }
    // The scan runs at most every kHandshakeCheck, not on every wake-up of a
    // busy loop that also has a handshake pending.
    if (!handshaking_.load()) {
      timeout_ms = -1;
    } else {
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_handshake_check) {
        next_handshake_check = now + kHandshakeCheck;
        expire_handshakes();
      }
      timeout_ms = handshaking_.load()
                       ? static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(
                                              next_handshake_check - now)
                                              .count())
                       : -1;
    }
    // Drop closed streams only after the batch: later events may name them.
    std::lock_guard lock(mu_);
    for (auto it = streams_.begin(); it != streams_.end();) {
      it = it->first->closed ? streams_.erase(it) : std::next(it);
    }
  }
}

void Worker::expire_handshakes() {
  const auto now = std::chrono::steady_clock::now();
  std::vector<std::shared_ptr<Stream>> expired;
  uint32_t waiting = 0;
  {
    std::lock_guard lock(mu_);
    for (auto& [raw, s] : streams_) {
      if (s->closed || !s->handshaking()) continue;
      if (now >= s->hello_deadline) {
        expired.push_back(s);
      } else {
        ++waiting;
      }
    }
    handshaking_.store(waiting);
  }
  for (auto& s : expired) transport_.expire_handshake(*s);
  transport_.flush_hostile_log();
}

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
  auto busy_poll = parse_busy_poll(o.get_string("tcp.busy_poll_us"));
  if (!busy_poll.ok()) return busy_poll.status();
  opt_.busy_poll = *busy_poll;
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
