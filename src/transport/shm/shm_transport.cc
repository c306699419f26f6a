// shm transport: the option table, start (listener, I/O thread, copy workers)
// and shutdown.
#include "transport/shm/shm_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <unordered_set>

#include "core/gpu_path.h"
#include "core/random_bytes.h"
#include "core/thread_name.h"
#include "core/usable_cpus.h"
#include "cuda/host_device_copy.h"
#include "ferry/gpu.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/common/unix_socket.h"
#include "transport/shm/shm_internal.h"

namespace ferry::shm {

const OptionSpec kShmOptionSpecs[] = {
    {"shm.socket_dir", OptionType::kString, "/tmp",
     "directory of the control socket ferry-<engine id>-<pid>.sock; peers must see the same "
     "directory (one mount namespace or a shared mount)"},
    {"shm.connect_timeout_ms", OptionType::kDurationMs, "5000",
     "time allowed for connecting and the handshake (both cross-memory attach probes)", 1, 600000},
    {"shm.allow_ptrace", OptionType::kBool, "true",
     "under Yama ptrace_scope 1, call prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) so same-user "
     "sibling processes may copy to and from this one (cross-memory attach follows ptrace "
     "rules)"},
    {"shm.max_request_segments", OptionType::kUint, "1024",
     "most segments in one request: one process_vm_* call (IOV_MAX is 1024)", 1,
     kMaxRequestSegments},
    {"shm.max_request_bytes", OptionType::kBytes, "4MiB",
     "most bytes in one request: larger segments are cut so that several copy threads of the "
     "target share one transfer",
     4096, 1ull << 30},
    {"shm.inline_bytes", OptionType::kBytes, "256KiB",
     "requests of at most this many bytes are served by the I/O thread itself (no hand-off to a "
     "copy thread); larger ones by the copy threads, in parallel",
     0, 1ull << 30},
    {"shm.busy_poll_us", OptionType::kUint, "50",
     "after serving a peer's request of at most 64 KiB the I/O thread keeps polling its sockets "
     "this long before it sleeps, so that the next small request of a peer waiting on its answer "
     "finds it awake (0: sleep at once)",
     0, 100000},
    {"shm.caller_polls", OptionType::kBool, "true",
     "a caller waiting on (or testing) a transfer of at most 256 KiB reads the connection's "
     "socket itself, so the answer completes it without a wake-up of the I/O thread (false: "
     "only the I/O thread reads)"},
    {"shm.copy_threads", OptionType::kUint, "0",
     "threads of the target that check and copy the requests of peers, in parallel: the most "
     "cores a large transfer into or out of this process keeps busy (0: by the CPUs this "
     "process may use: all of them up to 4, half of them up to 8)",
     0, 64},
    {"shm.cancel_timeout_ms", OptionType::kDurationMs, "250",
     "cancel() waits this long for the peer to answer requests already sent (the peer does the "
     "copy); then the connection is shut down",
     1, 3600000},
    {"shm.send_timeout_ms", OptionType::kDurationMs, "10000",
     "a peer that does not drain its control socket for this long is declared dead", 100, 3600000},
    {"shm.mode", OptionType::kString, "auto",
     "how bytes move between the two processes: auto (cross-memory attach when the probe at "
     "connect succeeds both ways, else shared-memory staging), cma (cross-memory attach only; a "
     "refused probe leaves host memory to another transport), staging (always through shared "
     "memory: two copies, no ptrace permission needed)"},
    {"shm.staging_bytes", OptionType::kBytes, "32MiB",
     "staging mode: size of the shared-memory area (a sealed memfd) each side creates per "
     "connection for the requests it initiates; it bounds the bytes in flight per connection "
     "and direction",
     kMinStagingBytes, kMaxStagingBytes},
    {"shm.request_ring", OptionType::kString, "auto",
     "small requests (shm.ring_max_bytes) and their answers go through a ring in shared memory "
     "instead of socket frames: the waiting caller reads its answer there without a system call, "
     "and the target polls the ring while it busy-polls (shm.busy_poll_us); the target checks "
     "and copies them exactly as socket requests. Used on a connection where both engines turn "
     "it on. auto: on where the process may use 2 CPUs or more (measured to pay on 2 as on 64), "
     "off with one; true: on; false: off (every small request a socket frame). GPU memory's "
     "staged requests take it as host memory's do"},
    {"shm.ring_max_bytes", OptionType::kBytes, "256KiB",
     "the largest request (payload bytes) that goes through the request ring", 0, 1 << 20},
};
const size_t kShmOptionSpecCount = std::size(kShmOptionSpecs);

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

// shm.request_ring. Through NIXL's API a blocking 4 KiB write took
// 12.3 -> 5.7 us (64 CPUs) and 13.2 -> 7.7 us (32 CPUs) with it, the bandwidth
// rows level or better. On 2 CPUs it was left off after one run beside two CPU
// hogs (58 us against 8.4); later runs found both settings bimodal there
// (ring 3.9 / 58.3 / 4.1 us, socket 57.6 / 61.9 / 8.7) and the ring 2.2 x
// faster on the idle machine (3.7-4.0 against 8.2-8.5 us): on from 2 CPUs
// (with one, the two sides could not both poll; docs/benchmarks.md, "shm: the
// request ring on by default on 2 CPUs too").
constexpr uint32_t kRingMinCpus = 2;
Result<bool> parse_request_ring(const std::string& v) {
  if (v == "auto") return usable_cpus() >= kRingMinCpus;
  auto b = parse_bool(v);
  if (!b.ok()) {
    return err::InvalidArgument(
        fmt::format("option shm.request_ring: '{}' is none of auto, true, false", v));
  }
  return *b;
}

}  // namespace

Connection::~Connection() {
  // Unpinned before the areas unmap (members are destroyed after this body).
  if (own_pinned == 1) cuda_unpin_host_range(own.data());
  if (theirs_pinned == 1) cuda_unpin_host_range(theirs.data());
  if (fd >= 0) ::close(fd);
  if (pidfd >= 0) ::close(pidfd);
  for (int received : rx_fds) ::close(received);
}

// ------------------------------------------------------------- lifecycle ---

ShmTransport::~ShmTransport() {
  shutdown(err::Cancelled("engine destroyed"));
}

TransportCaps ShmTransport::capabilities() const {
  TransportCaps caps;
  caps.host_memory = true;
  caps.cuda_memory = false;
  caps.same_host_only = true;
  caps.varies_by_peer = true;  // GPU memory where the connection stages it
  return caps;
}

TransportCaps ShmTransport::capabilities_for(PeerId peer) const {
  TransportCaps caps = capabilities();
  std::lock_guard lock(mu_);
  auto it = primary_.find(peer);
  if (cuda_here_ && it != primary_.end() && !it->second->dead.load() && it->second->stages_gpu()) {
    caps.cuda_memory = true;  // every route: the target copies GPU memory to or from the area
  }
  return caps;
}

std::string ShmTransport::peer_limits(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = primary_.find(peer);
  // Without CUDA here there is no GPU memory of ours to stage, and the
  // transport says only what it always said ("carries no GPU memory").
  if (!cuda_here_ || it == primary_.end() || it->second->dead.load() || it->second->stages_gpu()) {
    return {};
  }
  if (!opt_.gpu_areas) return "GPU memory not staged (engine.gpu_same_host_path)";
  if (opt_.mode == Mode::kCma) return "GPU memory not staged (shm.mode=cma keeps no staging areas)";
  return "GPU memory not staged (the peer keeps no staging areas for it: an older engine, "
         "shm.mode=cma or engine.gpu_same_host_path there)";
}

// Up to 4 CPUs all of them (the copies of a large transfer share the cores
// with the initiator anyway); above that half of them up to 8, about where
// one socket's memory system, not the cores, sets the rate of
// process_vm_readv/writev, and the other half is left to the application.
// Threads without work sleep.
uint32_t default_copy_threads(uint32_t cpus) {
  if (cpus <= 4) return std::max<uint32_t>(cpus, 1);
  return std::clamp<uint32_t>(cpus / 2, 4, 8);
}

Status ShmTransport::read_options() {
  const OptionSet& o = *ctx_.options;
  opt_.socket_dir = o.get_string("shm.socket_dir");
  while (opt_.socket_dir.size() > 1 && opt_.socket_dir.back() == '/') opt_.socket_dir.pop_back();
  if (opt_.socket_dir.empty() || opt_.socket_dir.front() != '/') {
    return err::InvalidArgument(fmt::format(
        "option shm.socket_dir: '{}' is not an absolute directory path", opt_.socket_dir));
  }
  opt_.connect_timeout = std::chrono::milliseconds(o.get_uint("shm.connect_timeout_ms"));
  opt_.allow_ptrace = o.get_bool("shm.allow_ptrace");
  opt_.max_request_segments = static_cast<uint32_t>(o.get_uint("shm.max_request_segments"));
  opt_.max_request_bytes = o.get_uint("shm.max_request_bytes");
  opt_.copy_threads = static_cast<uint32_t>(o.get_uint("shm.copy_threads"));
  if (opt_.copy_threads == 0) opt_.copy_threads = default_copy_threads(usable_cpus());
  opt_.cancel_timeout = std::chrono::milliseconds(o.get_uint("shm.cancel_timeout_ms"));
  opt_.inline_bytes = o.get_uint("shm.inline_bytes");
  opt_.busy_poll = std::chrono::microseconds(o.get_uint("shm.busy_poll_us"));
  opt_.caller_polls = o.get_bool("shm.caller_polls");
  opt_.send_timeout = std::chrono::milliseconds(o.get_uint("shm.send_timeout_ms"));
  const std::string& mode = o.get_string("shm.mode");
  if (mode == "auto") {
    opt_.mode = Mode::kAuto;
  } else if (mode == "cma") {
    opt_.mode = Mode::kCma;
  } else if (mode == "staging") {
    opt_.mode = Mode::kStaging;
  } else {
    return err::InvalidArgument(
        fmt::format("option shm.mode: '{}' is none of auto, cma, staging", mode));
  }
  opt_.staging_bytes = o.get_uint("shm.staging_bytes");
  auto ring = parse_request_ring(o.get_string("shm.request_ring"));
  if (!ring.ok()) return ring.status();
  opt_.request_ring = *ring;
  opt_.ring_max_bytes = o.get_uint("shm.ring_max_bytes");
  // The engine validated it; empty where only shm's options exist (tests).
  const std::string& gpu_path = o.get_string(kGpuSameHostPathOption);
  if (!gpu_path.empty()) {
    auto path = parse_gpu_same_host_path(gpu_path);
    if (!path.ok()) return path.status();
    opt_.gpu_areas = shm_stages_gpu(*path);
  }
  return Status::Ok();
}

Status ShmTransport::start(const TransportContext& context) {
  ctx_ = context;
  if (Status s = read_options(); !s.ok()) return s;
  cuda_here_ = opt_.gpu_areas && cuda_available(nullptr);
  // Thread names tell engines of one process apart, as tcp's do.
  static std::atomic<int> engines_started{0};
  thread_prefix_ = fmt::format("ferry{}", engines_started.fetch_add(1));

  if (Status s = check_self(); !s.ok()) {
    if (opt_.mode == Mode::kCma) return s;
    // Probes will fail too; every connection uses shared memory and says why.
    spdlog::info("ferry shm: {}; connections use shared-memory staging", s.message());
  }
  const int scope = yama_ptrace_scope();
  if (scope == 1 && opt_.allow_ptrace) {
    if (Status s = allow_any_ptracer(); s.ok()) {
      spdlog::info(
          "ferry shm: Yama ptrace_scope is 1; allowed same-user processes to attach to this one "
          "(PR_SET_PTRACER_ANY) so that sibling engines can copy to and from it "
          "(shm.allow_ptrace=false turns this off)");
    } else {
      spdlog::warn("ferry shm: {}; peers that are not ancestors of this process will be refused",
                   s.message());
    }
  } else if (scope == 1) {
    spdlog::info(
        "ferry shm: Yama ptrace_scope is 1 and shm.allow_ptrace is off: only ancestor processes "
        "may attach to this one; other peers use another transport");
  } else if (scope >= 2) {
    spdlog::warn(
        "ferry shm: Yama ptrace_scope is {}: the kernel refuses cross-memory attach between "
        "ordinary processes, so shm connections will fail their probe and use shared-memory "
        "staging",
        scope);
  }
  if (Status s = open_listener(); !s.ok()) return s;

  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  wakefd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || wakefd_ < 0) {
    return err::Internal(fmt::format("shm: epoll/eventfd: {}", errno_text(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeTag;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, wakefd_, &ev);
  ev.data.u64 = kListenTag;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, listen_fd_, &ev);

  for (uint32_t i = 0; i < opt_.copy_threads; ++i) {
    workers_.emplace_back([this, i] { worker_loop(static_cast<int>(i)); });
  }
  io_thread_ = std::thread([this] { io_loop(); });
  {
    std::lock_guard lock(mu_);
    started_ = true;
  }
  spdlog::debug("ferry shm: engine {} listening on {} ({} copy threads, shm.mode={})",
                hex_id(ctx_.engine_id), socket_path_, opt_.copy_threads, mode_name(opt_.mode));
  return Status::Ok();
}

Status ShmTransport::open_listener() {
  const std::string path =
      fmt::format("{}/ferry-{}-{}.sock", opt_.socket_dir == "/" ? "" : opt_.socket_dir,
                  hex_id(ctx_.engine_id), getpid());
  if (path.size() > kMaxSocketPath) {
    return err::InvalidArgument(
        fmt::format("shm: socket path {} is {} bytes, longer than the {} a Unix socket allows; "
                    "choose a shorter shm.socket_dir",
                    path, path.size(), kMaxSocketPath));
  }
  // The name holds our engine id and pid: a file there is a leftover, which
  // listen_at removes.
  auto fd = unix_socket::listen_at(path, "shm");
  if (!fd.ok()) {
    if (fd.status().code() != StatusCode::kNotSupported) return fd.status();
    // Not a bad setting but this machine (a read-only or missing directory):
    // the engine runs without shm and reports why.
    return err::NotSupported(fd.status().message() + " (shm.socket_dir)");
  }
  listen_fd_ = *fd;
  socket_path_ = path;
  return Status::Ok();
}

void ShmTransport::shutdown(const Status& reason) {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  if (io_thread_.joinable()) {
    io_stop_.store(true);
    uint64_t one = 1;
    [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
    io_thread_.join();
  }
  std::vector<std::shared_ptr<Connection>> all;
  {
    std::lock_guard lock(io_mu_);
    for (auto& [raw, c] : watched_) all.push_back(c);
    watched_.clear();
  }
  {
    std::lock_guard lock(mu_);
    all.insert(all.end(), open_.begin(), open_.end());
  }
  // Shutting the sockets down also wakes copy workers blocked in a send.
  for (auto& c : all) fail_connection(*c, reason, /*verbatim=*/true);
  {
    std::lock_guard lock(task_mu_);
    workers_stop_ = true;
  }
  task_cv_.notify_all();
  backlog_cv_.notify_all();
  for (auto& w : workers_) w.join();
  workers_.clear();
  std::deque<Task> left;
  {
    std::lock_guard lock(task_mu_);
    left.swap(tasks_);
  }
  for (auto& task : left) {
    if (task.notify_for) fail_transfer(*task.notify_for, reason);
    if (task.answered.transfer) fail_transfer(*task.answered.transfer, reason);
  }
  {
    std::lock_guard lock(mu_);
    primary_.clear();
    open_.clear();
  }
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(socket_path_.c_str());
    listen_fd_ = -1;
  }
  if (epfd_ >= 0) ::close(epfd_);
  if (wakefd_ >= 0) ::close(wakefd_);
  epfd_ = wakefd_ = -1;
}

Bytes ShmTransport::local_address() const {
  return encode_address({socket_path_, static_cast<uint32_t>(getpid())});
}

}  // namespace ferry::shm
