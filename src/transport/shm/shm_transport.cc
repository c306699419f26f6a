// shm transport: lifecycle, connections and handshake, the I/O thread, the
// copy workers (target side) and request bookkeeping (initiator side).
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

#include "core/random_bytes.h"
#include "core/thread_name.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/common/unix_socket.h"

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
};
const size_t kShmOptionSpecCount = std::size(kShmOptionSpecs);

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kWakeTag = 0;
constexpr uint64_t kListenTag = 1;
constexpr size_t kRxInitialBytes = 256 << 10;
constexpr auto kHandshakeCheck = std::chrono::milliseconds(100);

std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

// CPUs this process may run on.
uint32_t usable_cpus() {
  cpu_set_t set;
  long cpus = 0;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
  if (cpus <= 0) cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return static_cast<uint32_t>(std::max<long>(cpus, 1));
}

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX));
}

// Waits until `fd` is ready for `events` or the deadline passes.
Status wait_ready(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, ms_left(deadline));
    if (r > 0) return Status::Ok();
    if (r == 0) return err::Timeout(fmt::format("{} timed out", what));
    if (errno != EINTR) return err::Internal(fmt::format("poll: {}", errno_text(errno)));
  }
}

// Sends all of `data` on a non-blocking socket before `deadline`.
Status send_all(int fd, ByteView data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n =
        ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (Status s = wait_ready(fd, POLLOUT, deadline, "send"); !s.ok()) return s;
      continue;
    }
    return err::PeerDisconnected(fmt::format("send failed: {}", errno_text(errno)));
  }
  return Status::Ok();
}

// Descriptors that arrived with SCM_RIGHTS, closed unless taken.
struct ReceivedFds {
  ~ReceivedFds() { close_all(); }
  void close_all() {
    for (int fd : fds) ::close(fd);
    fds.clear();
  }
  std::vector<int> fds;
};

constexpr size_t kMaxFdsPerRecv = 4;

// One recvmsg: bytes into `out`, descriptors appended to *fds. Returns what
// recv would, or -2 (errno EPROTO) when descriptors were cut off.
ssize_t recv_with_fds(int fd, uint8_t* out, size_t n, std::vector<int>* fds) {
  iovec iov{out, n};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRecv)];
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control;
  m.msg_controllen = sizeof control;
  const ssize_t r = ::recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (r < 0) return r;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int received;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds->push_back(received);
    }
  }
  if ((m.msg_flags & MSG_CTRUNC) != 0) {
    errno = EPROTO;
    return -2;
  }
  return r;
}

// Receives exactly `n` bytes on a non-blocking socket before `deadline`,
// collecting descriptors that ride along (a HELLO_ACK's staging area).
Status recv_exact_fds(int fd, uint8_t* out, size_t n, Clock::time_point deadline,
                      std::vector<int>* fds) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = recv_with_fds(fd, out + done, n - done, fds);
    if (r > 0) {
      done += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return err::PeerDisconnected("the peer closed the connection");
    if (r == -2) return err::ProtocolError("the peer sent more descriptors than expected");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (Status s = wait_ready(fd, POLLIN, deadline, "receive"); !s.ok()) return s;
      continue;
    }
    return err::PeerDisconnected(fmt::format("receive failed: {}", errno_text(errno)));
  }
  return Status::Ok();
}

// Sends `frame` with descriptor `pass` attached to its first byte
// (SCM_RIGHTS); `pass` < 0 sends it plain. Whole or an error: handshake
// frames are small and go first on their socket.
ssize_t send_frame_fd(int fd, const Bytes& frame, int pass) {
  iovec iov{const_cast<uint8_t*>(frame.data()), frame.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (pass >= 0) {
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass, sizeof(int));
  }
  return ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
}

// A handshake frame on a fresh socket: its buffer is empty, so the frame fits
// at once; the I/O thread never waits for a peer. `pass` >= 0: a descriptor
// rides along.
Status send_now(int fd, const Bytes& frame, int pass = -1) {
  const ssize_t n = send_frame_fd(fd, frame, pass);
  if (n == static_cast<ssize_t>(frame.size())) return Status::Ok();
  if (n < 0) return err::PeerDisconnected(fmt::format("send failed: {}", errno_text(errno)));
  return err::Internal(
      fmt::format("handshake frame of {} bytes did not fit the socket ({} sent)", frame.size(), n));
}

// The peer's pid as this process's pid namespace sees it (the kernel
// translates it), 0 when it is not visible there; never a pid the peer claims.
Result<pid_t> peer_pid(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return err::Internal(fmt::format("shm: SO_PEERCRED failed: {}", errno_text(errno)));
  }
  // 0: the peer lives in a pid namespace this one cannot see into (a
  // container beside ours, or our parent's when we are the contained one).
  // Cross-memory attach then cannot reach it -- the probe says so -- and the
  // connection stages bytes through shared memory, which needs no pid.
  return cred.pid > 0 ? cred.pid : 0;
}

Result<sockaddr_un> unix_address(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.size() >= sizeof a.sun_path) {
    return err::InvalidArgument(
        fmt::format("shm: socket path {} is {} bytes, longer than the {} a Unix socket allows; "
                    "choose a shorter shm.socket_dir",
                    path, path.size(), sizeof a.sun_path - 1));
  }
  std::memcpy(a.sun_path, path.data(), path.size());
  return a;
}

// Calls piece(segment index, offset in it, length) for each piece of the
// requests `segments` are cut into, and close() after each request: at most
// `max_segments` pieces and `max_bytes` bytes per request, large segments cut
// into pieces of the bytes left in the request.
template <typename Piece, typename Close>
void cut_requests(const std::vector<Segment>& segments, uint32_t max_segments, uint64_t max_bytes,
                  Piece&& piece, Close&& close) {
  uint32_t pieces = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const uint64_t length = segments[i].length;
    uint64_t done = 0;
    while (done < length) {
      const uint64_t take = std::min(length - done, max_bytes - bytes);
      piece(i, done, take);
      done += take;
      bytes += take;
      if (++pieces == max_segments || bytes == max_bytes) {
        close();
        pieces = 0;
        bytes = 0;
      }
    }
  }
  if (pieces > 0) close();
}

}  // namespace

Connection::~Connection() {
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
  return caps;
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
  return Status::Ok();
}

Status ShmTransport::start(const TransportContext& context) {
  ctx_ = context;
  if (Status s = read_options(); !s.ok()) return s;
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

bool ShmTransport::is_connected(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = primary_.find(peer);
  return it != primary_.end() && !it->second->dead.load();
}

std::string ShmTransport::peer_address(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = primary_.find(peer);
  if (it == primary_.end() || it->second->dead.load()) return {};
  return fmt::format("pid {} via {}, {}", it->second->pid, it->second->via, it->second->mode_text);
}

std::string ShmTransport::describe(const Connection& c) const {
  if (c.peer == 0) return fmt::format("connection from pid {}", c.pid);
  return fmt::format("peer {} (pid {})", hex_id(c.peer), c.pid);
}

// --------------------------------------------------------------- connect ---

Result<PeerId> ShmTransport::connect(ByteView peer_address, PeerId expected_peer) {
  auto address = decode_address(peer_address);
  if (!address.ok()) return address.status();
  std::lock_guard serial(connect_mu_);
  if (expected_peer != 0 && is_connected(expected_peer)) return expected_peer;
  {
    std::lock_guard lock(mu_);
    if (!started_ || stopped_) return err::Cancelled("shm: the transport is not running");
  }
  auto c = std::make_shared<Connection>();
  c->outgoing = true;
  c->via = address->socket_path;
  auto probe_value = random_nonzero_u64();
  if (!probe_value.ok()) return probe_value.status();
  c->probe_value = *probe_value;
  const Status s = handshake_out(*c, *address, expected_peer, Clock::now() + opt_.connect_timeout);
  if (!s.ok()) {
    spdlog::info("ferry shm: connecting to {} (pid {}) failed: {}", address->socket_path,
                 address->pid, s.message());
    return s;
  }
  if (Status e = establish(c); !e.ok()) return e;
  return c->peer;
}

Status ShmTransport::handshake_out(Connection& c, const ShmAddress& address, PeerId expected_peer,
                                   Clock::time_point deadline) {
  // The pid in the address is the peer's claim, used in messages only.
  const std::string where = fmt::format("{} (pid {})", address.socket_path, address.pid);
  auto sa = unix_address(address.socket_path);
  if (!sa.ok()) return sa.status();
  c.fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c.fd < 0) return err::Internal(fmt::format("shm: socket(AF_UNIX): {}", errno_text(errno)));
  // A blocking connect waits only while the listener's backlog is full;
  // SO_SNDTIMEO bounds that wait.
  const int ms = std::max(1, ms_left(deadline));
  timeval tv{ms / 1000, (ms % 1000) * 1000};
  setsockopt(c.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (::connect(c.fd, reinterpret_cast<const sockaddr*>(&*sa), sizeof(sockaddr_un)) != 0) {
    const int e = errno;
    switch (e) {
      case ENOENT:
      case ECONNREFUSED:
        return err::PeerDisconnected(fmt::format(
            "shm: cannot connect to {}: {}: no engine listens there (it exited, or it runs in "
            "another mount namespace or with another shm.socket_dir)",
            where, errno_text(e)));
      case EAGAIN:
      case EINPROGRESS:
      case ETIMEDOUT:
        return err::Timeout(
            fmt::format("shm: connecting to {} timed out after {} ms (shm.connect_timeout_ms): {}",
                        where, opt_.connect_timeout.count(), errno_text(e)));
      case EACCES:
      case EPERM:
        return err::PermissionDenied(fmt::format(
            "shm: cannot connect to {}: {} (permissions of the socket or its directory)", where,
            errno_text(e)));
      default:
        return err::Internal(fmt::format("shm: cannot connect to {}: {}", where, errno_text(e)));
    }
  }
  const int flags = fcntl(c.fd, F_GETFL, 0);
  if (flags < 0 || fcntl(c.fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return err::Internal(fmt::format("shm: fcntl(O_NONBLOCK): {}", errno_text(errno)));
  }
  auto lost = [&](const Status& s) {
    return Status(
        s.code() == StatusCode::kTimeout ? StatusCode::kTimeout : StatusCode::kPeerDisconnected,
        fmt::format("shm: handshake with {} failed: {} (shm.connect_timeout_ms is {} ms)", where,
                    s.message(), opt_.connect_timeout.count()));
  };

  Hello hello;
  hello.engine_id = ctx_.engine_id;
  hello.expected_engine_id = expected_peer;
  hello.probe_address = reinterpret_cast<uint64_t>(&c.probe_value);
  hello.probe_value = c.probe_value;
  hello.mode = opt_.mode;
  if (Status s = send_all(c.fd, encode_hello(hello), deadline); !s.ok()) return lost(s);

  // The HELLO_ACK may carry the peer's staging area (SCM_RIGHTS).
  ReceivedFds fds;
  uint8_t head[kFrameHeaderBytes];
  if (Status s = recv_exact_fds(c.fd, head, sizeof head, deadline, &fds.fds); !s.ok()) {
    return lost(s);
  }
  auto h = decode_header(ByteView(head, sizeof head));
  if (!h.ok()) {
    return err::ProtocolError(
        fmt::format("shm: {} is not a Ferry shm engine: {}", where, h.status().message()));
  }
  if (h->op != Op::kHelloAck) {
    return err::ProtocolError(
        fmt::format("shm: {} answered the handshake with {}", where, op_name(h->op)));
  }
  if (h->version != kWireVersion) {
    return err::ProtocolError(
        fmt::format("shm: wire version mismatch with {}: peer speaks {}, this engine speaks {}",
                    where, h->version, kWireVersion));
  }
  Bytes body(h->body_bytes);
  if (Status s = recv_exact_fds(c.fd, body.data(), body.size(), deadline, &fds.fds); !s.ok()) {
    return lost(s);
  }
  auto ack = decode_hello_ack(body);
  if (!ack.status().ok()) {
    return err::ProtocolError(fmt::format("shm: {}: {}", where, ack.status().message()));
  }
  if (!ack->status.ok()) {
    return Status(ack->status.code(),
                  fmt::format("shm: {} refused the connection: {}", where, ack->status.message()));
  }
  auto refuse = [&](const Status& why) {
    HelloDone no;
    no.status = why;
    (void)send_all(c.fd, encode_hello_done(no), std::min(deadline, Clock::now() + kHandshakeCheck));
    return why;
  };
  if (expected_peer != 0 && ack->engine_id != expected_peer) {
    return refuse(
        err::InvalidArgument(fmt::format("shm: {} is engine {}, but the metadata names engine {}",
                                         where, hex_id(ack->engine_id), hex_id(expected_peer))));
  }
  auto pid = peer_pid(c.fd);
  if (!pid.ok()) return refuse(pid.status());
  c.pid = *pid;
  c.peer = ack->engine_id;
  // The pidfd is taken before the probe: a probe that succeeds proves the
  // process behind it is the one the probe read.
  c.pidfd = open_pidfd(c.pid);
  auto done = choose_mode(c, *ack, fds.fds);
  if (!done.ok()) {
    return refuse(
        Status(done.status().code(), fmt::format("shm: {}: {}", where, done.status().message())));
  }
  const Bytes frame = encode_hello_done(*done);
  const ssize_t sent = send_frame_fd(c.fd, frame, c.staged ? c.own.fd() : -1);
  if (sent != static_cast<ssize_t>(frame.size())) {
    return lost(err::PeerDisconnected(fmt::format(
        "sending HELLO_DONE failed: {}",
        sent < 0 ? errno_text(errno) : fmt::format("{} of {} bytes", sent, frame.size()))));
  }
  c.own.close_fd();
  c.state = Connection::State::kOpen;
  return Status::Ok();
}

namespace {
// Why a staged connection does not use cross-memory attach, for logs and
// peer_address().
std::string staging_text(Mode ours, Mode theirs, const std::string& refusal) {
  if (ours == Mode::kStaging) return "shared memory (shm.mode=staging on this engine)";
  if (theirs == Mode::kStaging) return "shared memory (shm.mode=staging on the peer)";
  std::string_view why = refusal;
  if (why.starts_with("shm: ")) why.remove_prefix(5);
  return fmt::format("shared memory (CMA refused: {})", why);
}

bool modes_conflict(Mode a, Mode b) {
  return (a == Mode::kCma && b == Mode::kStaging) || (a == Mode::kStaging && b == Mode::kCma);
}

std::string area_name(uint64_t engine, uint64_t peer) {
  return fmt::format("ferry-shm-{:016x}-to-{:016x}", engine, peer);
}
}  // namespace

Result<HelloDone> ShmTransport::choose_mode(Connection& c, const HelloAck& ack,
                                            std::vector<int>& fds) {
  if (modes_conflict(opt_.mode, ack.mode)) {
    return err::InvalidArgument(
        fmt::format("shm.mode is {} on this engine and {} on the peer: no common way to move bytes",
                    mode_name(opt_.mode), mode_name(ack.mode)));
  }
  const bool forced_staging = opt_.mode == Mode::kStaging || ack.mode == Mode::kStaging;
  const bool forced_cma = opt_.mode == Mode::kCma || ack.mode == Mode::kCma;
  HelloDone done;
  std::string refusal;  // why cross-memory attach is not used
  if (!forced_staging) {
    if (!ack.cma_refusal.empty()) {
      std::string_view why = ack.cma_refusal;
      if (why.starts_with("shm: ")) why.remove_prefix(5);
      refusal = fmt::format("the peer's probe of this process: {}", why);
      if (forced_cma) return err::PermissionDenied(refusal);  // the peer should have refused
    } else if (Status p = probe(c.pid, ack.probe_address, ack.probe_value); !p.ok()) {
      if (forced_cma) return p;
      done.cma_refusal = p.message();
      refusal = p.message();
    }
  }
  if (!forced_staging && refusal.empty()) {
    for (int fd : fds) ::close(fd);  // the area offered in case we needed it
    fds.clear();
    c.mode_text = "cross-memory attach";
    done.mode = Mode::kCma;
    return done;
  }
  if (ack.staging_bytes == 0 || fds.size() != 1) {
    return err::ProtocolError(fmt::format(
        "staging mode is needed ({}), but the peer's HELLO_ACK offered a staging area of {} bytes "
        "with {} descriptor(s)",
        forced_staging ? "shm.mode=staging" : refusal, ack.staging_bytes, fds.size()));
  }
  const int fd = fds.front();
  fds.clear();
  auto theirs = StagingArea::adopt(fd, ack.staging_bytes);
  if (!theirs.ok()) return theirs.status();
  auto own = StagingArea::create(opt_.staging_bytes, area_name(ctx_.engine_id, c.peer));
  if (!own.ok()) return own.status();
  c.theirs = std::move(theirs.value());
  c.own = std::move(own.value());
  c.ring = StagingRing(c.own.size());
  c.staged = true;
  c.mode_text = staging_text(opt_.mode, ack.mode, refusal);
  done.mode = Mode::kStaging;
  done.staging_bytes = c.own.size();
  return done;
}

Status ShmTransport::establish(const std::shared_ptr<Connection>& c) {
  {
    std::lock_guard lock(mu_);
    // Under mu_, so that shutdown() (which sets stopped_ under mu_) either
    // finds this connection in open_ or we find stopped_ set.
    if (stopped_) return err::Cancelled("shm: the transport is shutting down");
    {
      std::lock_guard g(c->mu);
      c->established = true;
    }
    open_.push_back(c);
    auto& slot = primary_[c->peer];
    if (!slot || slot->dead.load()) slot = c;
    lost_.erase(c->peer);
    if (c->outgoing) watch(c);  // accepted ones are watched since accept
  }
  ctx_.events->on_peer_up(c->peer);
  // The mode is this connection's own choice (each probe, shm.mode on both
  // sides): say it once, with why shared memory was taken.
  spdlog::info("ferry shm: {} engine {} (pid {}) via {}: {}",
               c->outgoing ? "connected to" : "accepted", hex_id(c->peer), c->pid, c->via,
               c->mode_text);
  return Status::Ok();
}

void ShmTransport::watch(const std::shared_ptr<Connection>& c) {
  {
    std::lock_guard lock(io_mu_);
    watched_[c.get()] = c;
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = reinterpret_cast<uint64_t>(c.get());
  epoll_ctl(epfd_, EPOLL_CTL_ADD, c->fd, &ev);
}

// ------------------------------------------------------------- I/O thread ---

void ShmTransport::io_loop() {
  name_this_thread(thread_prefix_ + "-shm-io");
  epoll_event events[64];
  std::vector<std::shared_ptr<Connection>> closed;
  auto next_check = Clock::time_point{};
  while (!io_stop_.load(std::memory_order_relaxed)) {
    int timeout_ms = -1;
    if (handshaking_ > 0) timeout_ms = ms_left(next_check);
    const int n = epoll_wait(epfd_, events, 64, timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("ferry shm: epoll_wait failed: {}", errno_text(errno));
      return;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = events[i].data.u64;
      if (tag == kWakeTag) {
        uint64_t v;
        [[maybe_unused]] auto r = ::read(wakefd_, &v, sizeof v);
        continue;
      }
      if (tag == kListenTag) {
        on_accept();
        continue;
      }
      auto* c = reinterpret_cast<Connection*>(tag);
      if (!c->dead.load()) on_readable(*c);
      if (c->dead.load()) {
        // Out of the epoll set now; freed only after this batch.
        epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd, nullptr);
        closed.push_back(c->shared_from_this());
      }
    }
    if (handshaking_ > 0 && Clock::now() >= next_check) {
      next_check = Clock::now() + kHandshakeCheck;
      expire_handshakes();
    }
    if (!closed.empty()) {
      std::lock_guard lock(io_mu_);
      for (auto& c : closed) watched_.erase(c.get());
    }
    closed.clear();
  }
}

void ShmTransport::on_accept() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        spdlog::warn("ferry shm: accept on {} failed: {}", socket_path_, errno_text(errno));
      }
      return;
    }
    auto probe_value = random_nonzero_u64();
    if (!probe_value.ok()) {
      spdlog::warn("ferry shm: refusing a connection on {}: {}", socket_path_,
                   probe_value.status().message());
      ::close(fd);
      continue;
    }
    auto c = std::make_shared<Connection>();
    c->fd = fd;
    c->via = socket_path_;
    c->state = Connection::State::kAwaitHello;
    c->handshake_deadline = Clock::now() + opt_.connect_timeout;
    c->probe_value = *probe_value;
    if (auto pid = peer_pid(fd); pid.ok()) c->pid = *pid;
    watch(c);
    ++handshaking_;
  }
}

void ShmTransport::expire_handshakes() {
  const auto now = Clock::now();
  std::vector<std::shared_ptr<Connection>> expired;
  int waiting = 0;
  {
    std::lock_guard lock(io_mu_);
    for (auto& [raw, c] : watched_) {
      if (c->dead.load() || c->state == Connection::State::kOpen) continue;
      if (now >= c->handshake_deadline) {
        expired.push_back(c);
      } else {
        ++waiting;
      }
    }
  }
  handshaking_ = waiting;
  for (auto& c : expired) {
    spdlog::warn(
        "ferry shm: closing {}: no complete handshake within {} ms (shm.connect_timeout_ms)",
        describe(*c), opt_.connect_timeout.count());
    fail_connection(*c, err::Timeout("handshake timed out"));
  }
}

void ShmTransport::on_readable(Connection& c) {
  if (c.rx.empty()) c.rx.resize(kRxInitialBytes);
  // A bounded number of reads per wake-up keeps one busy peer from starving
  // the others.
  for (int round = 0; round < 16; ++round) {
    if (c.rx_len == c.rx.size()) c.rx.resize(c.rx.size() * 2);
    const size_t space = c.rx.size() - c.rx_len;
    // recvmsg: a HELLO_DONE brings the peer's staging area (SCM_RIGHTS).
    const ssize_t n = recv_with_fds(c.fd, c.rx.data() + c.rx_len, space, &c.rx_fds);
    if (n == -2 || c.rx_fds.size() > 1 ||
        (!c.rx_fds.empty() && c.state == Connection::State::kOpen)) {
      const Status why = err::ProtocolError(
          fmt::format("{} sent {} file descriptor(s){}; only a HELLO_DONE carries one", describe(c),
                      c.rx_fds.size(), n == -2 ? " and more that were cut off" : ""));
      spdlog::warn("ferry shm: closing {}: {}", describe(c), why.message());
      fail_connection(c, why);
      return;
    }
    if (n == 0) {
      fail_connection(c, err::PeerDisconnected("the peer closed it (its process exited?)"));
      return;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR) continue;
      fail_connection(c,
                      err::PeerDisconnected(fmt::format("receive failed: {}", errno_text(errno))));
      return;
    }
    c.rx_len += static_cast<size_t>(n);
    Status s = parse_frames(c);
    if (s.ok() && !c.rx_fds.empty() && c.state == Connection::State::kOpen) {
      s = err::ProtocolError(fmt::format(
          "{} file descriptor(s) arrived with frames after the handshake", c.rx_fds.size()));
    }
    if (!s.ok()) {
      spdlog::warn("ferry shm: closing {}: {}", describe(c), s.message());
      fail_connection(c, s);
      return;
    }
    if (c.dead.load() || static_cast<size_t>(n) < space) return;
  }
}

Status ShmTransport::parse_frames(Connection& c) {
  size_t pos = 0;
  Status result;
  while (c.rx_len - pos >= kFrameHeaderBytes) {
    auto h = decode_header(ByteView(c.rx.data() + pos, kFrameHeaderBytes));
    if (!h.ok()) return h.status();
    const size_t need = kFrameHeaderBytes + h->body_bytes;
    if (c.rx_len - pos < need) break;
    result = on_frame(c, *h, ByteView(c.rx.data() + pos + kFrameHeaderBytes, h->body_bytes));
    pos += need;
    if (!result.ok()) return result;
    if (c.dead.load()) return Status::Ok();
  }
  if (pos > 0) {
    std::memmove(c.rx.data(), c.rx.data() + pos, c.rx_len - pos);
    c.rx_len -= pos;
  }
  // Room for the whole frame in progress (its header was checked above).
  if (c.rx_len >= kFrameHeaderBytes) {
    auto h = decode_header(ByteView(c.rx.data(), kFrameHeaderBytes));
    const size_t need = kFrameHeaderBytes + h->body_bytes;
    if (need > c.rx.size()) c.rx.resize(need);
  }
  return Status::Ok();
}

Status ShmTransport::on_frame(Connection& c, const FrameHeader& h, ByteView body) {
  switch (c.state) {
    case Connection::State::kAwaitHello:
      if (h.op != Op::kHello) {
        return err::ProtocolError(fmt::format("expected HELLO, got {}", op_name(h.op)));
      }
      return on_hello(c, h, body);
    case Connection::State::kAwaitHelloDone:
      if (h.op != Op::kHelloDone) {
        return err::ProtocolError(fmt::format("expected HELLO_DONE, got {}", op_name(h.op)));
      }
      return on_hello_done(c, body);
    case Connection::State::kOpen:
      break;
  }
  if (is_request(h.op)) {
    auto request = decode_request(h, body);
    if (!request.ok()) return request.status();
    if (request->op != Op::kNotifyReq && request->staged != c.staged) {
      return err::ProtocolError(fmt::format(
          "{} {} {} staging area offsets on a connection in {} mode", op_name(request->op),
          request->id, request->staged ? "names" : "does not name",
          c.staged ? "staging" : "cross-memory attach"));
    }
    // Small requests are served here: a hand-off to a copy worker costs a
    // thread wake-up, more than copying a few pages. Large ones go to the
    // workers, which copy in parallel.
    if (request->total_bytes() <= opt_.inline_bytes) {
      serve_inline(c.shared_from_this(), *request);
    } else {
      submit(Task{c.shared_from_this(), std::move(request.value()), nullptr, {}});
    }
    return Status::Ok();
  }
  if (h.op == Op::kResponse) return on_response(c, body);
  if (h.op == Op::kCancel) return on_cancel(c, body);
  return err::ProtocolError(fmt::format("unexpected {} after the handshake", op_name(h.op)));
}

Status ShmTransport::on_hello(Connection& c, const FrameHeader& h, ByteView body) {
  // A refusal is explained to the connecting engine, then the connection closes.
  auto refuse = [&](const Status& why) {
    HelloAck ack;
    ack.status = why;
    ack.engine_id = ctx_.engine_id;
    (void)send_now(c.fd, encode_hello_ack(ack));
    return why;
  };
  if (h.version != kWireVersion) {
    return refuse(err::ProtocolError(
        fmt::format("shm wire version mismatch: the connecting engine speaks {}, this engine "
                    "speaks {}",
                    h.version, kWireVersion)));
  }
  auto hello = decode_hello(body);
  if (!hello.ok()) return refuse(hello.status());
  auto pid = peer_pid(c.fd);
  if (!pid.ok()) return refuse(pid.status());
  c.pid = *pid;
  c.peer = hello->engine_id;
  if (hello->expected_engine_id != 0 && hello->expected_engine_id != ctx_.engine_id) {
    return refuse(err::InvalidArgument(
        fmt::format("shm: {} belongs to engine {}, but engine {} (pid {}) expected engine {} there",
                    socket_path_, hex_id(ctx_.engine_id), hex_id(c.peer), c.pid,
                    hex_id(hello->expected_engine_id))));
  }
  if (modes_conflict(opt_.mode, hello->mode)) {
    return refuse(err::InvalidArgument(fmt::format(
        "shm.mode is {} on engine {} and {} on engine {} (pid {}): no common way to move bytes",
        mode_name(opt_.mode), hex_id(ctx_.engine_id), mode_name(hello->mode), hex_id(c.peer),
        c.pid)));
  }
  c.peer_mode = hello->mode;
  const bool forced_staging = opt_.mode == Mode::kStaging || hello->mode == Mode::kStaging;
  const bool forced_cma = opt_.mode == Mode::kCma || hello->mode == Mode::kCma;
  c.pidfd = open_pidfd(c.pid);
  HelloAck ack;
  ack.mode = opt_.mode;
  if (!forced_staging) {
    if (Status s = probe(c.pid, hello->probe_address, hello->probe_value); !s.ok()) {
      if (forced_cma) return refuse(s);
      // Not a refusal: the connection will run in staging mode; the
      // connecting engine learns why.
      c.cma_refusal = s.message();
      ack.cma_refusal = s.message();
    }
  }
  if (!forced_cma) {
    // Offered whenever staging may be chosen: the connecting engine's own
    // probe, which decides too, comes after this answer.
    auto own = StagingArea::create(opt_.staging_bytes, area_name(ctx_.engine_id, c.peer));
    if (own.ok()) {
      c.own = std::move(own.value());
      ack.staging_bytes = c.own.size();
    } else if (forced_staging || !c.cma_refusal.empty()) {
      return refuse(own.status());
    } else {
      spdlog::warn("ferry shm: no staging area for {}: {}; only cross-memory attach can serve it",
                   describe(c), own.status().message());
    }
  }
  ack.engine_id = ctx_.engine_id;
  ack.probe_address = reinterpret_cast<uint64_t>(&c.probe_value);
  ack.probe_value = c.probe_value;
  if (Status s = send_now(c.fd, encode_hello_ack(ack), c.own.fd()); !s.ok()) return s;
  c.state = Connection::State::kAwaitHelloDone;
  return Status::Ok();
}

Status ShmTransport::on_hello_done(Connection& c, ByteView body) {
  auto done = decode_hello_done(body);
  if (!done.ok()) return done.status();
  if (!done->status.ok()) {
    return Status(done->status.code(),
                  fmt::format("engine {} (pid {}) cannot use this connection: {}", hex_id(c.peer),
                              c.pid, done->status.message()));
  }
  const std::string who = fmt::format("engine {} (pid {})", hex_id(c.peer), c.pid);
  if (done->mode == Mode::kStaging) {
    if (opt_.mode == Mode::kCma || !c.own.valid()) {
      return err::ProtocolError(fmt::format(
          "{} chose staging mode, but this engine {}", who,
          opt_.mode == Mode::kCma ? "runs with shm.mode=cma" : "offered no staging area"));
    }
    if (c.rx_fds.size() != 1) {
      return err::ProtocolError(fmt::format(
          "{} chose staging mode with {} descriptor(s) on its HELLO_DONE, expected its area", who,
          c.rx_fds.size()));
    }
    const int fd = c.rx_fds.front();
    c.rx_fds.clear();
    auto theirs = StagingArea::adopt(fd, done->staging_bytes);
    if (!theirs.ok()) {
      return Status(theirs.status().code(), fmt::format("{}: {}", who, theirs.status().message()));
    }
    c.theirs = std::move(theirs.value());
    c.own.close_fd();
    c.ring = StagingRing(c.own.size());
    c.staged = true;
    const std::string refusal =
        !c.cma_refusal.empty() || done->cma_refusal.empty()
            ? c.cma_refusal
            : fmt::format("the peer's probe of this process: {}",
                          std::string_view(done->cma_refusal)
                              .substr(done->cma_refusal.starts_with("shm: ") ? 5 : 0));
    c.mode_text = staging_text(opt_.mode, c.peer_mode, refusal);
  } else {
    if (opt_.mode == Mode::kStaging || !c.cma_refusal.empty() || !c.rx_fds.empty()) {
      return err::ProtocolError(
          fmt::format("{} chose cross-memory attach, but {}", who,
                      opt_.mode == Mode::kStaging ? "this engine runs with shm.mode=staging"
                      : !c.cma_refusal.empty()
                          ? fmt::format("this engine's probe of it failed: {}", c.cma_refusal)
                          : std::string("its HELLO_DONE carries a descriptor")));
    }
    c.own.reset();
    c.mode_text = "cross-memory attach";
  }
  c.state = Connection::State::kOpen;
  return establish(c.shared_from_this());
}

Status ShmTransport::on_response(Connection& c, ByteView body) {
  auto response = decode_response(body);
  if (!response.ok()) return response.status();
  Pending p;
  {
    std::lock_guard lock(c.mu);
    auto it = c.pending.find(response->id);
    if (it == c.pending.end()) {
      return err::ProtocolError(
          fmt::format("RESPONSE for request {}, which is not in flight", response->id));
    }
    p = std::move(it->second);
    c.pending.erase(it);
    const std::shared_ptr<Transfer>& t = p.transfer;
    auto f = c.in_flight.find(t.get());
    if (f != c.in_flight.end() && --f->second == 0) {
      c.in_flight.erase(f);
      c.idle_cv.notify_all();  // cancel() may wait for this transfer
    }
  }
  const std::shared_ptr<Transfer>& t = p.transfer;
  if (!response->status.ok()) {
    // The target's message names the region and offset; add who said it.
    t->note_error(Status(response->status.code(),
                         fmt::format("{} (from {})", response->status.message(), describe(c))));
  } else if (!p.copy_out.empty()) {
    uint64_t bytes = 0;
    for (const CopyPiece& piece : p.copy_out) bytes += piece.length;
    if (bytes > opt_.inline_bytes) {
      // Large: a copy thread copies it out, so the I/O thread keeps
      // reading and several answers are copied out at once.
      Task task;
      task.conn = c.shared_from_this();
      task.answered = std::move(p);
      submit(std::move(task));
      return Status::Ok();
    }
    copy_out(*t, c, p.copy_out);
  }
  finish_answer(c, p);
  return Status::Ok();
}

void ShmTransport::finish_answer(Connection& c, const Pending& p) {
  // Answered (and a read's bytes taken): the target is done with the range.
  if (p.range != kNoRange) release_range(c, p.range);
  if (p.transfer->outstanding.fetch_sub(1) == 1) finish(c.shared_from_this(), p.transfer);
}

void ShmTransport::copy_out(Transfer& t, const Connection& c, std::span<const CopyPiece> pieces) {
  // Under io_mu: cancel() (which sets `cancelled` under it first) returns
  // only after a copy that started, and none starts after it.
  std::lock_guard io(t.io_mu);
  if (t.cancelled) return;
  for (const CopyPiece& piece : pieces) {
    std::memcpy(piece.local, c.own.data() + piece.remote, piece.length);
  }
}

void ShmTransport::release_range(Connection& c, uint64_t offset) {
  bool drain = false;
  {
    std::lock_guard lock(c.staging_mu);
    c.ring.release(offset);
    // An answer to a request of a cancelled write: the peer's copy of it is
    // over. The last one lets the backlog go.
    c.fence.erase(offset);
    if (!c.backlog.empty() && !c.draining && c.fence.empty() && !c.dead.load()) {
      c.draining = true;
      drain = true;
    }
  }
  // A copy worker drains: the I/O thread must not copy megabytes or block
  // on a send.
  if (drain) {
    Task task;
    task.conn = c.shared_from_this();
    task.drain = true;
    submit(std::move(task));
  }
}

Status ShmTransport::stage(const std::shared_ptr<Connection>& c, StagedRequest request,
                           uint64_t* budget) {
  uint64_t at = 0;
  bool queued = false;
  bool drain = false;
  {
    std::lock_guard lock(c->staging_mu);
    if (c->dead.load()) {
      return err::PeerDisconnected(fmt::format("shm: connection to {} is closed", describe(*c)));
    }
    std::optional<uint64_t> range;
    if (c->backlog.empty() && c->fence.empty() && request.bytes <= *budget) {
      range = c->ring.allocate(request.bytes);
    }
    if (!range) {
      // The rest of this post queues too (the caller's thread copies one
      // area's worth at most, and requests stay in order).
      *budget = 0;
      c->backlog.push_back(std::move(request));
      queued = true;
      // A release starts the drain while a range is in use (a fenced one
      // among them); else (answers came back meanwhile) nobody would: start
      // it here.
      if (!c->draining && c->fence.empty()) {
        c->draining = true;
        drain = true;
      }
    } else {
      at = *range;
      *budget -= request.bytes;
    }
  }
  if (drain) {
    Task task;
    task.conn = c;
    task.drain = true;
    submit(std::move(task));
  }
  if (queued) return Status::Ok();
  return send_staged(c, request, at);
}

Status ShmTransport::send_staged(const std::shared_ptr<Connection>& c, StagedRequest& request,
                                 uint64_t at) {
  if (request.op == Op::kNotifyReq) {  // held by the cancel fence; no bytes, no range
    const uint64_t id = next_request_id_.fetch_add(1);
    return send_request(c, request.transfer, id,
                        encode_request(Op::kNotifyReq, id, {}, true, request.notification));
  }
  for (WireSegment& w : request.segments) w.address += at;
  for (CopyPiece& p : request.copies) p.remote += at;
  Pending entry;
  entry.range = at;
  std::span<const CopyPiece> copy_in;
  if (request.op == Op::kReadReq) {
    entry.copy_out = std::move(request.copies);
  } else {
    copy_in = request.copies;
  }
  const uint64_t id = next_request_id_.fetch_add(1);
  return send_request(c, request.transfer, id,
                      encode_request(request.op, id, request.segments, request.embed_notification,
                                     request.notification, /*staged=*/true),
                      std::move(entry), copy_in);
}

void ShmTransport::drain_backlog(const std::shared_ptr<Connection>& c) {
  bool sent_notification = false;
  for (;;) {
    StagedRequest request;
    uint64_t at;
    {
      std::lock_guard lock(c->staging_mu);
      // Only once it is sent may a later notification skip the backlog.
      if (sent_notification) --c->held_notifications;
      sent_notification = false;
      std::optional<uint64_t> range;
      if (!c->dead.load() && !c->backlog.empty() && c->fence.empty()) {
        const StagedRequest& front = c->backlog.front();
        range = front.op == Op::kNotifyReq ? kNoRange : c->ring.allocate(front.bytes);
      }
      if (!range) {
        c->draining = false;  // a later release starts the next drain
        return;
      }
      at = *range;
      request = std::move(c->backlog.front());
      c->backlog.pop_front();
    }
    // A cancelled transfer sends nothing. A failed send fails the
    // connection and with it the transfer -- unless the connection failed
    // just before (it fails only what is pending or queued, and this
    // request is neither): then the transfer fails here.
    Status s = send_staged(c, request, at);
    if (!s.ok() && s.code() != StatusCode::kCancelled) fail_transfer(*request.transfer, s);
    sent_notification = request.op == Op::kNotifyReq;
  }
}

// ------------------------------------------------------ target: copy work ---

void ShmTransport::submit(Task task) {
  size_t waiting;
  {
    std::lock_guard lock(task_mu_);
    tasks_.push_back(std::move(task));
    waiting = tasks_.size();
  }
  task_cv_.notify_one();
  // A backlog (a large transfer's requests): wake a worker beyond the first
  // kEagerCopyThreads too.
  if (waiting >= 2) backlog_cv_.notify_one();
}

void ShmTransport::worker_loop(int index) {
  name_this_thread(fmt::format("{}-shm-cp-{}", thread_prefix_, index));
  for (;;) {
    Task task;
    {
      std::unique_lock lock(task_mu_);
      // The first kEagerCopyThreads workers are woken for every task; the
      // others only while tasks queue up, so a few requests in flight keep
      // going to the same, recently busy threads (a thread idle for long
      // wakes later) and only a backlog spreads over the whole budget.
      std::condition_variable& cv =
          static_cast<uint32_t>(index) < kEagerCopyThreads ? task_cv_ : backlog_cv_;
      cv.wait(lock, [&] { return workers_stop_ || !tasks_.empty(); });
      if (workers_stop_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    if (task.drain) {
      drain_backlog(task.conn);
    } else if (task.answered.transfer) {
      copy_out(*task.answered.transfer, *task.conn, task.answered.copy_out);
      finish_answer(*task.conn, task.answered);
    } else if (!task.response.empty()) {
      if (Status st = send_frame(*task.conn, task.response); !st.ok()) {
        fail_connection(*task.conn, st);
      }
    } else if (task.notify_for) {
      send_write_notification(task.conn, task.notify_for);
    } else {
      serve(*task.conn, task.request);
    }
  }
}

Status ShmTransport::validate(const Connection& c, const Request& request,
                              std::vector<RegionPin>* pins, std::vector<CopyPiece>* pieces) const {
  const uint8_t wanted = request.op == Op::kWriteReq ? kAccessWrite : kAccessRead;
  pieces->reserve(request.segments.size());
  for (size_t i = 0; i < request.segments.size(); ++i) {
    const WireSegment& seg = request.segments[i];
    // The peer names ranges of its own area; we trust none of them beyond
    // our mapping of it.
    if (request.staged && !c.theirs.contains(seg.address, seg.remote.length)) {
      return err::ProtocolError(fmt::format(
          "shm: {} {} of {}, segment {}: staging range at offset {} of {} bytes lies outside the "
          "peer's {}-byte staging area; nothing was copied",
          op_name(request.op), request.id, describe(c), i, seg.address, seg.remote.length,
          c.theirs.size()));
    }
    RegionPin pin;
    auto local = ctx_.registry->check_remote(seg.remote, wanted, &pin);
    if (!local.ok()) {
      return Status(local.status().code(),
                    fmt::format("shm: {} {} of {}, segment {}: {}", op_name(request.op), request.id,
                                describe(c), i, local.status().message()));
    }
    const Region* region = pin.get();
    if (region->info.kind != MemoryKind::kHost) {
      return err::NotSupported(
          fmt::format("shm: region {} is {} memory; the shm transport carries host memory only",
                      seg.remote.region_id, memory_kind_name(region->info.kind)));
    }
    // Blocks adjacent on both sides (pages of one KV run, say) become one
    // iovec: the kernel pins and copies a run in one pass instead of per block.
    CopyPiece* last = pieces->empty() ? nullptr : &pieces->back();
    if (last && last->local + last->length == *local &&
        last->remote + last->length == seg.address) {
      last->length += seg.remote.length;
    } else {
      pieces->push_back({*local, seg.address, seg.remote.length});
    }
    // One pin per run of segments in the same region is enough.
    if (pins->empty() || pins->back().get() != region) pins->push_back(std::move(pin));
  }
  return Status::Ok();
}

Status ShmTransport::on_cancel(Connection& c, ByteView body) {
  auto ids = decode_cancel(body);
  if (!ids.ok()) return ids.status();
  std::unordered_set<uint64_t> wanted(ids->begin(), ids->end());
  std::lock_guard lock(task_mu_);
  for (Task& t : tasks_) {
    if (t.conn.get() == &c && !t.notify_for && wanted.count(t.request.id)) {
      t.request.cancelled = true;
    }
  }
  return Status::Ok();
}

namespace {
// The peer shut its end down (it gave up on us: cancel timeout, protocol
// error) while requests it sent before may still be queued here.
bool peer_hung_up(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// Right before a cross-memory-attach copy into or out of the initiator's
// memory: the initiator still wants it. The check itself is a system call,
// where a stop signal takes effect: a process stopped there (SIGSTOP, a
// debugger) resumes with a stale answer while its initiator may have given
// up meanwhile (shm.cancel_timeout_ms) and reused the memory. So a check
// that took longer than kFreshCheck is made again: the copy starts within
// kFreshCheck of an answer that said the initiator is still there.
constexpr auto kFreshCheck = std::chrono::milliseconds(20);
bool initiator_still_there(const Connection& c) {
  for (;;) {
    const auto asked = std::chrono::steady_clock::now();
    if (c.dead.load() || peer_hung_up(c.fd)) return false;
    if (std::chrono::steady_clock::now() - asked < kFreshCheck) return true;
  }
}
}  // namespace

// Counts the copies under way while it lives, and the most seen at once.
class CopyInFlight {
 public:
  CopyInFlight(std::atomic<uint32_t>& now, std::atomic<uint32_t>& peak) : now_(now) {
    const uint32_t n = now_.fetch_add(1, std::memory_order_relaxed) + 1;
    uint32_t seen = peak.load(std::memory_order_relaxed);
    while (n > seen && !peak.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
    }
  }
  ~CopyInFlight() { now_.fetch_sub(1, std::memory_order_relaxed); }
  CopyInFlight(const CopyInFlight&) = delete;
  CopyInFlight& operator=(const CopyInFlight&) = delete;

 private:
  std::atomic<uint32_t>& now_;
};

std::vector<std::pair<std::string, uint64_t>> ShmTransport::counters() const {
  return {{"copy_threads", opt_.copy_threads},
          {"requests_copied", requests_copied_.load(std::memory_order_relaxed)},
          {"peak_parallel_copies", peak_parallel_copies_.load(std::memory_order_relaxed)}};
}

std::optional<Status> ShmTransport::execute(Connection& c, Request& request) {
  // The initiator is gone, or we gave up on it (cancel timeout, protocol
  // error), or it gave up on us: copy nothing more into or out of its memory.
  if (c.dead.load() || peer_hung_up(c.fd)) return std::nullopt;
  if (request.cancelled) {
    return err::Cancelled(
        fmt::format("shm: {} {} was cancelled by the initiator before it was served",
                    op_name(request.op), request.id));
  }
  std::vector<RegionPin> pins;
  std::vector<CopyPiece> pieces;
  Status verdict = validate(c, request, &pins, &pieces);
  if (verdict.ok()) {
    // Deregistration started after the check: it waits for our pins, but the
    // owner wants the region left alone, so nothing is copied.
    for (const RegionPin& pin : pins) {
      if (pin.get()->revoked.load(std::memory_order_acquire)) {
        verdict = err::NotFound(fmt::format(
            "shm: region {} was deregistered before {} {} was served; nothing was copied",
            pin.get()->info.id, op_name(request.op), request.id));
        break;
      }
    }
  }
  std::optional<CopyInFlight> copying;
  if (verdict.ok() && !pieces.empty()) {
    requests_copied_.fetch_add(1, std::memory_order_relaxed);
    copying.emplace(copies_in_flight_, peak_parallel_copies_);
  }
  if (verdict.ok() && !pieces.empty() && request.staged) {
    // Between the region and the peer's area, both mapped here: nothing can
    // fail half-way (the area is sealed against shrinking, every range was
    // checked against its size).
    uint8_t* area = c.theirs.data();
    for (const CopyPiece& p : pieces) {
      if (request.op == Op::kWriteReq) {
        std::memcpy(p.local, area + p.remote, p.length);
      } else {
        std::memcpy(area + p.remote, p.local, p.length);
      }
    }
  } else if (verdict.ok() && !pieces.empty()) {
    if (process_exited(c.pidfd)) return std::nullopt;  // its EOF follows; the pid may be reused
    size_t failed = 0;
    uint64_t moved = 0;
    const Direction direction = request.op == Op::kWriteReq ? Direction::kPull : Direction::kPush;
    if (Status s = cma_copy(c.pid, direction, pieces, &failed, &moved,
                            [&c] { return initiator_still_there(c); });
        !s.ok()) {
      if (s.code() == StatusCode::kCancelled) {  // the initiator gave up on us meanwhile
        spdlog::debug("ferry shm: {}: dropping {} {}: {}", describe(c), op_name(request.op),
                      request.id, s.message());
        return std::nullopt;
      }
      if (s.code() == StatusCode::kPeerDisconnected) {  // ESRCH: the initiator died
        spdlog::debug("ferry shm: {}: dropping {} {}: {}", describe(c), op_name(request.op),
                      request.id, s.message());
        return std::nullopt;
      }
      // Pieces may merge segments: find the segment the copy stopped in.
      (void)failed;
      size_t at = 0;
      for (uint64_t sum = 0; at + 1 < request.segments.size(); ++at) {
        sum += request.segments[at].remote.length;
        if (sum > moved) break;
      }
      const WireSegment& seg = request.segments[at];
      verdict = Status(s.code(), fmt::format("shm: {} {}: copy stopped in region {} at offset {} "
                                             "after {} bytes: {}",
                                             op_name(request.op), request.id, seg.remote.region_id,
                                             seg.remote.offset, moved, s.message()));
    }
  }
  copying.reset();
  pins.clear();  // deregistration need not wait for the notification and answer
  if (verdict.ok() && request.has_notification) {
    ctx_.events->on_notification(c.peer, std::move(request.notification));
  }
  return verdict;
}

void ShmTransport::serve(Connection& c, Request& request) {
  const std::optional<Status> verdict = execute(c, request);
  if (!verdict) return;
  if (Status s = send_frame(c, encode_response(request.id, *verdict)); !s.ok()) {
    fail_connection(c, s);
  }
}

void ShmTransport::serve_inline(const std::shared_ptr<Connection>& c, Request& request) {
  const std::optional<Status> verdict = execute(*c, request);
  if (!verdict) return;
  Bytes frame = encode_response(request.id, *verdict);
  if (!try_send_now(*c, frame)) submit(Task{c, {}, nullptr, std::move(frame)});
}

// The I/O thread must never block on a send (both ends must always drain
// their sockets): it sends only if the lock is free and the frame fits now.
// A small frame on a Unix stream socket is one skb, sent whole or not at all.
bool ShmTransport::try_send_now(Connection& c, const Bytes& frame) {
  std::unique_lock lock(c.send_mu, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (c.dead.load()) return true;  // nobody to answer
  const ssize_t n = ::send(c.fd, frame.data(), frame.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n == static_cast<ssize_t>(frame.size())) return true;
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
  if (n >= 0) {  // part of it went: the rest must follow before anything else
    const ByteView rest = ByteView(frame).subspan(static_cast<size_t>(n));
    if (send_all(c.fd, rest, Clock::now() + opt_.send_timeout).ok()) return true;
  }
  const int e = errno;
  lock.unlock();
  fail_connection(c, err::PeerDisconnected(fmt::format("send failed: {}", errno_text(e))));
  return true;
}

// ------------------------------------------------------ initiator: posts ---

Result<std::shared_ptr<Connection>> ShmTransport::live_connection(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = primary_.find(peer);
  if (it != primary_.end() && !it->second->dead.load()) return it->second;
  if (auto l = lost_.find(peer); l != lost_.end()) {
    return err::PeerDisconnected(
        fmt::format("shm: peer {} is disconnected ({})", hex_id(peer), l->second));
  }
  return err::NotFound(fmt::format("shm: no connection to peer {}", hex_id(peer)));
}

Status ShmTransport::post_write(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                std::vector<Segment> segments) {
  return post(peer, transfer, segments, Op::kWriteReq);
}

Status ShmTransport::post_read(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                               std::vector<Segment> segments) {
  return post(peer, transfer, segments, Op::kReadReq);
}

Status ShmTransport::post(PeerId peer, const std::shared_ptr<Transfer>& t,
                          const std::vector<Segment>& segments, Op op) {
  const char* what = op == Op::kWriteReq ? "write" : "read";
  if (segments.empty()) return err::InvalidArgument(fmt::format("shm: {} with no segments", what));
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.local_device >= 0 || s.remote_device >= 0) {
      return err::NotSupported(fmt::format(
          "shm carries host memory only: {} segment {} to peer {} names GPU memory (local "
          "device {}, remote device {})",
          what, i, hex_id(peer), s.local_device, s.remote_device));
    }
  }
  auto conn = live_connection(peer);
  if (!conn.ok()) return conn.status();
  const bool notify = op == Op::kWriteReq && t->has_notification;
  if (notify && t->notification.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes exceeds the limit of {}",
                                            t->notification.size(), kMaxNotificationBytes));
  }
  const uint32_t max_segments = opt_.max_request_segments;
  const bool staged = (*conn)->staged;
  uint64_t max_bytes = opt_.max_request_bytes;
  if (staged) {
    // At least four requests in flight fit the area: the copy into it, the
    // target's copies and the copy out of it overlap.
    max_bytes = std::min(max_bytes, std::max(kStagingAlign, (*conn)->own.size() / 4));
  }
  uint64_t requests = 0;
  cut_requests(
      segments, max_segments, max_bytes, [](size_t, uint64_t, uint64_t) {}, [&] { ++requests; });
  // A write that fits one request carries its notification: the target
  // delivers it after the copy. Otherwise it follows the last response.
  const bool embed = notify && requests == 1;
  Bytes note;
  if (embed) {
    note = std::move(t->notification);
    t->has_notification = false;
  }
  t->outstanding.store(requests);

  std::vector<WireSegment> current;
  current.reserve(std::min<size_t>(max_segments, segments.size()));
  // Staging: each piece's place in the request's range, and the copies
  // into (write) or out of (read) our area.
  uint64_t staged_bytes = 0;
  std::vector<CopyPiece> copies;
  uint64_t direct_budget = staged ? (*conn)->own.size() : 0;  // bytes this thread may copy
  Status result;
  bool stop = false;
  cut_requests(
      segments, max_segments, max_bytes,
      [&](size_t i, uint64_t offset, uint64_t length) {
        if (stop) return;
        const Segment& s = segments[i];
        WireSegment w;
        w.remote = s.remote;
        w.remote.offset += offset;
        w.remote.length = length;
        if (staged) {
          w.address = staged_bytes;  // made absolute once the range is reserved
          copies.push_back({s.local + offset, staged_bytes, length});
          staged_bytes += length;
        } else {
          w.address = reinterpret_cast<uint64_t>(s.local) + offset;
        }
        current.push_back(w);
      },
      [&] {
        if (stop) return;
        Status s;
        if (staged) {
          StagedRequest request;
          request.transfer = t;
          request.op = op;
          request.segments = std::move(current);
          request.copies = std::move(copies);
          request.bytes = staged_bytes;
          request.embed_notification = embed;
          request.notification = note;
          s = stage(*conn, std::move(request), &direct_budget);
        } else {
          const uint64_t id = next_request_id_.fetch_add(1);
          s = send_request(*conn, t, id, encode_request(op, id, current, embed, note));
        }
        current.clear();
        copies.clear();
        staged_bytes = 0;
        if (!s.ok()) {
          stop = true;
          // Cancelled: the transfer was cancelled or failed meanwhile; whoever
          // did that completes it.
          if (s.code() != StatusCode::kCancelled) result = s;
        }
      });
  return result;
}

Status ShmTransport::post_notification(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                       Bytes payload) {
  if (payload.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes exceeds the limit of {}",
                                            payload.size(), kMaxNotificationBytes));
  }
  auto conn = live_connection(peer);
  if (!conn.ok()) return conn.status();
  transfer->outstanding.store(1);
  if ((*conn)->staged && hold_notification(*conn, transfer, payload)) return Status::Ok();
  const uint64_t id = next_request_id_.fetch_add(1);
  Status s =
      send_request(*conn, transfer, id, encode_request(Op::kNotifyReq, id, {}, true, payload));
  return s.code() == StatusCode::kCancelled ? Status::Ok() : s;
}

bool ShmTransport::hold_notification(const std::shared_ptr<Connection>& c,
                                     const std::shared_ptr<Transfer>& t, Bytes& payload) {
  bool drain = false;
  {
    std::lock_guard lock(c->staging_mu);
    if ((c->fence.empty() && c->held_notifications == 0) || c->dead.load()) return false;
    StagedRequest request;
    request.transfer = t;
    request.op = Op::kNotifyReq;
    request.embed_notification = true;
    request.notification = std::move(payload);
    c->backlog.push_back(std::move(request));
    ++c->held_notifications;
    // The fence's last release drains; with the fence down, a drain is
    // sending the held ones already, or is started here.
    if (!c->draining && c->fence.empty()) {
      c->draining = true;
      drain = true;
    }
  }
  if (drain) {
    Task task;
    task.conn = c;
    task.drain = true;
    submit(std::move(task));
  }
  return true;
}

Status ShmTransport::send_request(const std::shared_ptr<Connection>& c,
                                  const std::shared_ptr<Transfer>& t, uint64_t id,
                                  const Bytes& frame, Pending entry,
                                  std::span<const CopyPiece> copy_in) {
  const uint64_t range = entry.range;
  Status refused;
  {
    // Under io_mu: cancel() either sees this request in in_flight and waits
    // for its answer, or we see `cancelled` and send nothing.
    std::lock_guard io(t->io_mu);
    if (t->cancelled) {
      refused = err::Cancelled("");
    } else {
      // A staged write's bytes go into our area before the peer can see
      // the request; cancel() waits for this copy out of local memory.
      for (const CopyPiece& p : copy_in) {
        std::memcpy(c->own.data() + p.remote, p.local, p.length);
      }
      std::lock_guard lock(c->mu);
      if (c->dead.load()) {
        refused =
            err::PeerDisconnected(fmt::format("shm: connection to {} is closed", describe(*c)));
      } else {
        entry.transfer = t;
        c->pending.emplace(id, std::move(entry));
        ++c->in_flight[t.get()];
      }
    }
  }
  if (!refused.ok()) {
    if (range != kNoRange) release_range(*c, range);
    return refused;
  }
  Status s = send_frame(*c, frame);
  if (!s.ok()) fail_connection(*c, s);  // fails `t` with the others in flight
  return s;
}

void ShmTransport::finish(const std::shared_ptr<Connection>& c,
                          const std::shared_ptr<Transfer>& t) {
  {
    std::lock_guard io(t->io_mu);
    if (t->cancelled) return;  // cancel() or a failure completes it
  }
  Status error = t->first_error();
  if (!error.ok()) {
    t->complete(std::move(error));
    return;
  }
  if (t->op() == TransferOp::kWrite && t->has_notification) {
    // Every request is answered, so every byte is placed: the notification
    // may go now. The I/O thread never sends (it must keep reading), so a
    // copy worker does; its answer completes the transfer.
    t->has_notification = false;
    submit(Task{c, Request{}, t});
    return;
  }
  t->complete(Status::Ok());
}

void ShmTransport::send_write_notification(const std::shared_ptr<Connection>& c,
                                           const std::shared_ptr<Transfer>& t) {
  t->outstanding.store(1);
  const uint64_t id = next_request_id_.fetch_add(1);
  Status s = send_request(c, t, id, encode_request(Op::kNotifyReq, id, {}, true, t->notification));
  if (!s.ok() && s.code() != StatusCode::kCancelled) fail_transfer(*t, s);
}

void ShmTransport::cancel(Transfer& t) {
  {
    std::lock_guard io(t.io_mu);
    t.cancelled = true;  // requests not yet sent are dropped
  }
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard lock(mu_);
    for (auto& c : open_) {
      if (c->peer == t.peer()) conns.push_back(c);
    }
  }
  // The peer copies into or out of our memory until it answers. Tell it to
  // skip what it has not started, then (cross-memory attach) wait for every
  // request already sent, bounded by shm.cancel_timeout_ms.
  const bool write = t.op() == TransferOp::kWrite;
  for (auto& c : conns) {
    std::vector<uint64_t> ids;
    {
      // Staged requests not sent yet never will be: drop them (and with
      // them the pointers into the caller's memory).
      std::lock_guard staging(c->staging_mu);
      std::erase_if(c->backlog, [&](const StagedRequest& r) {
        if (r.transfer.get() != &t) return false;
        if (r.op == Op::kNotifyReq) --c->held_notifications;
        return true;
      });
      // Under staging_mu too: an answer that arrives now gives its range
      // back only after the range joined the fence.
      std::lock_guard lock(c->mu);
      for (const auto& [id, p] : c->pending) {
        if (p.transfer.get() != &t) continue;
        ids.push_back(id);
        // Staging: the peer may be copying this request's bytes from its
        // area into its region right now, and will until it answers. Later
        // requests wait for that answer (Connection::fence).
        if (write && p.range != kNoRange) c->fence.insert(p.range);
      }
    }
    for (size_t at = 0; at < ids.size(); at += kMaxCancelIds) {
      const size_t n = std::min<size_t>(kMaxCancelIds, ids.size() - at);
      if (!send_frame(*c, encode_cancel(std::span(ids).subspan(at, n))).ok()) break;
    }
  }
  const auto deadline = Clock::now() + opt_.cancel_timeout;
  for (auto& c : conns) {
    // Staging: the peer copies only into and out of our area, never into
    // the caller's memory; our own copies check `cancelled` under io_mu. So
    // nothing to wait for, and a stalled peer keeps its connection: its late
    // answers give the ranges back, and lift the fence that holds later
    // requests back until the cancelled write's copies on the peer are over.
    if (c->staged) continue;
    std::unique_lock lock(c->mu);
    const bool idle = c->idle_cv.wait_until(
        lock, deadline, [&] { return c->dead.load() || c->in_flight.count(&t) == 0; });
    if (idle) continue;
    const uint32_t left = c->in_flight[&t];
    lock.unlock();
    const Status why = err::Timeout(fmt::format(
        "cancel of transfer {} waited {} ms (shm.cancel_timeout_ms) for {} to answer {} "
        "request(s) it may still be copying; the connection is shut down",
        t.id(), opt_.cancel_timeout.count(), describe(*c), left));
    spdlog::warn("ferry shm: {}", why.message());
    fail_connection(*c, why);
  }
}

// ------------------------------------------------------- send and failure ---

Status ShmTransport::send_frame(Connection& c, const Bytes& frame) {
  std::lock_guard lock(c.send_mu);
  if (c.dead.load()) {
    return err::PeerDisconnected(fmt::format("shm: connection to {} is closed", describe(c)));
  }
  Status s = send_all(c.fd, frame, Clock::now() + opt_.send_timeout);
  if (s.ok()) return s;
  if (s.code() == StatusCode::kTimeout) {
    return err::Timeout(
        fmt::format("shm: {} did not drain its socket for {} ms (shm.send_timeout_ms)", describe(c),
                    opt_.send_timeout.count()));
  }
  return Status(s.code(), fmt::format("shm: {}: {}", describe(c), s.message()));
}

void ShmTransport::fail_transfer(Transfer& t, const Status& status) {
  {
    std::lock_guard io(t.io_mu);
    t.cancelled = true;  // nothing more of it is sent
  }
  t.complete(status);
}

void ShmTransport::fail_connection(Connection& c, const Status& reason, bool verbatim) {
  std::unordered_map<uint64_t, Pending> pending;
  bool established;
  {
    std::lock_guard lock(c.mu);
    if (c.dead.load()) return;
    c.dead.store(true);
    pending.swap(c.pending);
    c.in_flight.clear();
    established = c.established;
  }
  c.idle_cv.notify_all();
  std::deque<StagedRequest> backlog;  // staged requests never sent
  {
    std::lock_guard lock(c.staging_mu);
    backlog.swap(c.backlog);
  }
  // Wakes the I/O thread (EPOLLHUP) to drop it and any sender blocked on it;
  // the descriptor itself closes with the last reference.
  ::shutdown(c.fd, SHUT_RDWR);
  const Status status = verbatim
                            ? reason
                            : err::PeerDisconnected(fmt::format("shm: connection to {} closed: {}",
                                                                describe(c), reason.message()));
  if (established) {
    bool report = false;
    {
      std::lock_guard lock(mu_);
      std::erase_if(open_, [&](const std::shared_ptr<Connection>& o) { return o.get() == &c; });
      auto it = primary_.find(c.peer);
      if (it != primary_.end() && it->second.get() == &c) {
        primary_.erase(it);
        // Both sides may have connected at once: another live connection to
        // the same peer takes over and the peer stays up.
        for (auto& o : open_) {
          if (o->peer == c.peer && !o->dead.load()) {
            primary_[c.peer] = o;
            break;
          }
        }
        report = primary_.count(c.peer) == 0;
        if (report) lost_[c.peer] = status.message();
      }
    }
    if (verbatim && reason.code() == StatusCode::kCancelled) {
      spdlog::debug("ferry shm: {}", status.message());
    } else if (pending.empty()) {
      spdlog::info("ferry shm: connection to {} closed: {} (no request was in flight)", describe(c),
                   reason.message());
    } else {
      spdlog::warn("ferry shm: connection to {} closed: {} ({} request(s) in flight fail)",
                   describe(c), reason.message(), pending.size());
    }
    if (report) ctx_.events->on_peer_down(c.peer, status);
  }
  for (auto& [id, p] : pending) {
    const std::shared_ptr<Transfer>& t = p.transfer;
    // A transfer the caller cancelled is completed by the engine (Cancelled);
    // one failed earlier is complete already.
    bool cancelled;
    {
      std::lock_guard io(t->io_mu);
      cancelled = t->cancelled;
    }
    if (!cancelled) fail_transfer(*t, status);
  }
  for (StagedRequest& r : backlog) {
    bool cancelled;
    {
      std::lock_guard io(r.transfer->io_mu);
      cancelled = r.transfer->cancelled;
    }
    if (!cancelled) fail_transfer(*r.transfer, status);
  }
}

}  // namespace ferry::shm
