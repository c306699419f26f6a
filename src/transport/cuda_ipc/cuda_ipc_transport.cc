#include "transport/cuda_ipc/cuda_ipc_transport.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/byte_codec.h"
#include "core/cpu_relax.h"
#include "cuda/cuda_detect.h"
#include "fmt/format.h"
#include "fmt/ranges.h"
#include "spdlog/spdlog.h"
#include "transport/common/unix_socket.h"

namespace ferry::cuda_ipc {

const OptionSpec kCudaIpcOptionSpecs[] = {
    {"cuda_ipc.socket_dir", OptionType::kString, "/tmp",
     "directory of the control socket ferry-ipc-<engine id>-<pid>.sock; peers must see the same "
     "directory"},
    {"cuda_ipc.connect_timeout_ms", OptionType::kDurationMs, "5000",
     "time allowed for connecting and the handshake", 1, 600000},
    {"cuda_ipc.grant_timeout_ms", OptionType::kDurationMs, "10000",
     "time allowed for the peer to answer a grant request (mapping a region for the first time)", 1,
     600000},
    {"cuda_ipc.revoke_timeout_ms", OptionType::kDurationMs, "2000",
     "a peer that has not released a deregistered region this long after being asked loses its "
     "connection (deregistration then completes)",
     1, 600000},
    {"cuda_ipc.send_timeout_ms", OptionType::kDurationMs, "10000",
     "a peer that does not drain its control socket for this long is declared dead", 100, 3600000},
    {"cuda_ipc.sm_budget", OptionType::kUint, "8",
     "most SMs the copy kernel for small blocks may occupy (0: copy engine only)", 0, 1024},
    {"cuda_ipc.poll_linger_us", OptionType::kUint, "50",
     "after the last copy in flight completed, the completion thread keeps polling this long "
     "before it sleeps (a next copy is then noticed without a wake-up)",
     0, 100000},
    {"cuda_ipc.waiter_polls", OptionType::kBool, "true",
     "a thread spinning in wait() polls the copy streams itself (no hand-over from the "
     "completion thread)"},
    {"cuda_ipc.after_default_stream", OptionType::kBool, "true",
     "copies start after work already queued on the GPU's legacy default stream (where PyTorch "
     "produces tensors unless told otherwise), so a tensor filled just before a write or read "
     "is filled first; false: the caller synchronises"},
    {"cuda_ipc.engine_max_blocks", OptionType::kUint, "1",
     "calls of at most this many blocks go to the copy engine (cudaMemcpyAsync) rather than the "
     "copy kernel: for a single small block that is lower latency than a kernel launch",
     0, 1024},
    {"cuda_ipc.kernel_max_block", OptionType::kBytes, "256KiB",
     "blocks smaller than this go through the copy kernel, larger ones to the copy engine", 0,
     1ull << 30},
    {"cuda_ipc.peer_kernel_max_block", OptionType::kBytes, "256KiB",
     "the same for copies between two GPUs (over NVLink or PCIe peer access): there the copy "
     "engine pays more per block",
     0, 1ull << 30},
    {"cuda_ipc.batch_api", OptionType::kBool, "true",
     "copy-engine blocks of a call go to one cudaMemcpyBatchAsync (false: one cudaMemcpyAsync "
     "each)"},
    {"cuda_ipc.trace", OptionType::kBool, "false",
     "stage trace of every transfer this engine initiates over cuda_ipc (posted, copies "
     "submitted, copies seen done, completed; docs/trace.md); off costs one branch"},
    {"cuda_ipc.trace_keep", OptionType::kUint, "4096",
     "finished traced transfers kept for reading (the last N)", 1, 1u << 20},
};
const size_t kCudaIpcOptionSpecCount = std::size(kCudaIpcOptionSpecs);

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kWakeTag = 0;
constexpr uint64_t kListenTag = 1;
constexpr size_t kRxChunk = 64 << 10;
constexpr size_t kMaxQueuedFds = kMaxPieces + kMaxFdsPerFrame;

// A short pause in a polling loop (about a microsecond), easing the CPU and
// the driver lock while another thread polls.
void cpu_relax_for_a_moment() {
  for (int i = 0; i < 32; ++i) cpu_relax();
}

std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

GrantKey key_of(const RemoteAccessRequest& r) {
  return {r.region_id, r.adv_offset, r.adv_length, r.key, r.access};
}

// The op of a whole frame, for messages (header: u32 magic | u16 version | u8 op).
const char* frame_op_name(const Bytes& frame) {
  return frame.size() < kFrameHeaderBytes ? "a frame" : op_name(static_cast<Op>(frame[6]));
}

// Reads one whole frame from a blocking socket (handshake only).
Result<std::pair<FrameHeader, Bytes>> read_frame_blocking(int fd, Clock::time_point deadline) {
  Bytes buf(kFrameHeaderBytes);
  auto read_exact = [&](uint8_t* p, size_t n) -> Status {
    size_t got = 0;
    while (got < n) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return err::Timeout("cuda_ipc: no handshake answer in time");
      timeval tv{static_cast<time_t>(left.count() / 1000),
                 static_cast<suseconds_t>((left.count() % 1000) * 1000)};
      ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      const ssize_t r = ::recv(fd, p + got, n - got, 0);
      if (r == 0) return err::PeerDisconnected("cuda_ipc: the peer closed during the handshake");
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return err::PeerDisconnected("cuda_ipc: handshake: " + unix_socket::errno_text(errno));
      }
      got += static_cast<size_t>(r);
    }
    return Status::Ok();
  };
  if (Status s = read_exact(buf.data(), buf.size()); !s.ok()) return s;
  auto h = decode_header(buf);
  if (!h.ok()) return h.status();
  Bytes body(h->body_bytes);
  if (Status s = read_exact(body.data(), body.size()); !s.ok()) return s;
  return std::make_pair(*h, std::move(body));
}

}  // namespace

Connection::~Connection() {
  if (fd >= 0) ::close(fd);
  for (int d : rx_fds) ::close(d);
  for (auto& [id, w] : grant_waits) {
    for (int d : w.fds) ::close(d);
  }
}

CudaIpcTransport::~CudaIpcTransport() {
  shutdown(err::Cancelled("cuda_ipc transport destroyed"));
}

TransportCaps CudaIpcTransport::capabilities() const {
  TransportCaps caps;
  caps.host_memory = false;
  caps.cuda_memory = true;
  caps.cuda_peer_only = true;
  caps.gpu_to_peer_host = true;  // target-driven: PUSH_EXPORT + COPY_REQ
  caps.same_host_only = true;
  return caps;
}

Status CudaIpcTransport::read_options() {
  const OptionSet& o = *ctx_.options;
  opt_.socket_dir = o.get_string("cuda_ipc.socket_dir");
  opt_.connect_timeout = std::chrono::milliseconds(o.get_uint("cuda_ipc.connect_timeout_ms"));
  opt_.grant_timeout = std::chrono::milliseconds(o.get_uint("cuda_ipc.grant_timeout_ms"));
  opt_.revoke_timeout = std::chrono::milliseconds(o.get_uint("cuda_ipc.revoke_timeout_ms"));
  opt_.send_timeout = std::chrono::milliseconds(o.get_uint("cuda_ipc.send_timeout_ms"));
  opt_.sm_budget = static_cast<uint32_t>(o.get_uint("cuda_ipc.sm_budget"));
  opt_.kernel_max_block = o.get_uint("cuda_ipc.kernel_max_block");
  opt_.peer_kernel_max_block = o.get_uint("cuda_ipc.peer_kernel_max_block");
  opt_.batch_api = o.get_bool("cuda_ipc.batch_api");
  opt_.waiter_polls = o.get_bool("cuda_ipc.waiter_polls");
  opt_.after_default_stream = o.get_bool("cuda_ipc.after_default_stream");
  opt_.engine_max_blocks = static_cast<uint32_t>(o.get_uint("cuda_ipc.engine_max_blocks"));
  opt_.poll_linger = std::chrono::microseconds(o.get_uint("cuda_ipc.poll_linger_us"));
  if (o.get_bool("cuda_ipc.trace")) {
    trace_log_ = trace_log_for(ctx_.engine_id, o.get_uint("cuda_ipc.trace_keep"));
  }
  return Status::Ok();
}

Status CudaIpcTransport::start(const TransportContext& context) {
  ctx_ = context;
  if (Status s = read_options(); !s.ok()) return s;
  auto gpus = visible_gpus();
  if (!gpus.ok()) return err::NotSupported("cuda_ipc: " + gpus.status().message());
  address_.gpus = *gpus;
  for (size_t i = 0; i < gpus->size(); ++i) {
    address_.gpu_pci.push_back(cuda_device_pci(static_cast<int>(i)));
  }
  address_.pid = static_cast<uint32_t>(::getpid());
  socket_path_ =
      fmt::format("{}/ferry-ipc-{}-{}.sock", opt_.socket_dir == "/" ? "" : opt_.socket_dir,
                  hex_id(ctx_.engine_id), ::getpid());
  address_.socket_path = socket_path_;
  auto fd = unix_socket::listen_at(socket_path_, "cuda_ipc");
  if (!fd.ok()) return fd.status();
  listen_fd_ = *fd;
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wakefd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || wakefd_ < 0) {
    return err::Internal("cuda_ipc: epoll/eventfd: " + unix_socket::errno_text(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeTag;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, wakefd_, &ev);
  ev.data.u64 = kListenTag;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  {
    std::lock_guard lock(mu_);
    started_ = true;
  }
  io_thread_ = std::thread([this] { io_loop(); });
  completion_thread_ = std::thread([this] { completion_loop(); });
  spdlog::debug("cuda_ipc: listening on {} ({} GPUs)", socket_path_, address_.gpus.size());
  return Status::Ok();
}

void CudaIpcTransport::shutdown(const Status& reason) {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    if (!started_) return;
  }
  io_stop_.store(true);
  uint64_t one = 1;
  [[maybe_unused]] auto w = ::write(wakefd_, &one, sizeof one);
  if (io_thread_.joinable()) io_thread_.join();
  std::vector<std::shared_ptr<Connection>> all;
  {
    std::lock_guard lock(io_mu_);
    for (auto& [raw, c] : watched_) all.push_back(c);
    watched_.clear();
  }
  for (auto& c : all) fail_connection(*c, reason);
  // Copies already on the GPU finish (they cannot be called back); the
  // completion thread completes their transfers, failed, as the connections
  // are dead.
  {
    std::lock_guard lock(completion_mu_);
    completion_stop_ = true;
  }
  completion_cv_.notify_all();
  if (completion_thread_.joinable()) completion_thread_.join();
  {
    std::lock_guard lock(slots_mu_);
    for (auto& s : slots_) {
      for (InFlight& f : s->fifo) {
        if (f.transfer) f.transfer->complete(reason);
      }
      s->fifo.clear();
    }
    slots_.clear();  // CopyStream's destructor waits for its stream
  }
  {
    std::lock_guard lock(mu_);
    primary_.clear();
    open_.clear();
  }
  revokes_.clear();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(socket_path_.c_str());
  }
  if (epfd_ >= 0) ::close(epfd_);
  if (wakefd_ >= 0) ::close(wakefd_);
  listen_fd_ = epfd_ = wakefd_ = -1;
}

Bytes CudaIpcTransport::local_address() const {
  return encode_address(address_);
}

std::string CudaIpcTransport::local_address_text() const {
  return fmt::format("unix:{} ({} GPU{})", socket_path_, address_.gpus.size(),
                     address_.gpus.size() == 1 ? "" : "s");
}

std::string CudaIpcTransport::describe(const Connection& c) const {
  return fmt::format("cuda_ipc connection to engine {} (pid {}, {})", hex_id(c.peer), c.pid, c.via);
}

// ------------------------------------------------------------- set-up ---

Result<PeerId> CudaIpcTransport::connect(ByteView peer_address, PeerId expected_peer) {
  auto a = decode_address(peer_address);
  if (!a.ok()) return a.status();
  if (a->gpus.empty()) {
    return err::NotSupported("cuda_ipc: the peer's address names no GPU");
  }
  // GPUs are named by UUID: a peer launched with another CUDA_VISIBLE_DEVICES
  // numbers them differently, and may use one this process does not see. Its
  // memory is mapped all the same (Mapping::import), copied by our GPU.
  std::vector<std::string> unseen;
  for (size_t i = 0; i < a->gpus.size(); ++i) {
    if (ordinal_of(a->gpus[i]) < 0) unseen.push_back(gpu_text(*a, i));
  }
  std::lock_guard connect_lock(connect_mu_);
  if (expected_peer != 0 && is_connected(expected_peer)) return expected_peer;
  const auto deadline = Clock::now() + opt_.connect_timeout;
  auto fd = unix_socket::connect_to(a->socket_path, opt_.connect_timeout, "cuda_ipc");
  if (!fd.ok()) return fd.status();
  auto c = std::make_shared<Connection>();
  c->fd = *fd;
  c->outgoing = true;
  c->via = a->socket_path;
  unix_socket::set_send_timeout(c->fd, opt_.send_timeout);
  auto pid = unix_socket::peer_pid(c->fd);
  if (!pid.ok()) return pid.status();
  c->pid = *pid;
  if (Status s = send_frame(*c, encode_hello({ctx_.engine_id, expected_peer})); !s.ok()) return s;
  auto frame = read_frame_blocking(c->fd, deadline);
  if (!frame.ok()) {
    return Status(frame.status().code(),
                  fmt::format("{} (peer at {})", frame.status().message(), a->socket_path));
  }
  if (frame->first.op != Op::kHelloAck) {
    return err::ProtocolError(fmt::format("cuda_ipc: expected HELLO_ACK from {}, got {}",
                                          a->socket_path, op_name(frame->first.op)));
  }
  if (frame->first.version != kWireVersion) {
    return err::ProtocolError(
        fmt::format("cuda_ipc: peer at {} speaks wire version {}, this "
                    "engine {}",
                    a->socket_path, frame->first.version, kWireVersion));
  }
  auto ack = decode_hello_ack(frame->second);
  if (!ack.ok()) return ack.status();
  if (!ack->status.ok()) return ack->status;
  if (expected_peer != 0 && ack->engine_id != expected_peer) {
    return err::InvalidArgument(fmt::format("cuda_ipc: {} belongs to engine {}, expected {}",
                                            a->socket_path, hex_id(ack->engine_id),
                                            hex_id(expected_peer)));
  }
  c->peer = ack->engine_id;
  c->established = true;
  if (Status s = establish(c); !s.ok()) return s;
  watch(c);
  if (!unseen.empty()) {
    c->gpu_note =
        fmt::format("; peer GPU{} {} not visible here: mapped through this process's GPU {}",
                    unseen.size() == 1 ? "" : "s", fmt::join(unseen, ", "), current_device());
    spdlog::info(
        "cuda_ipc: peer {}: its GPU{} {} not visible in this process "
        "(CUDA_VISIBLE_DEVICES); their memory is mapped into GPU {}'s context and "
        "copied by it",
        hex_id(c->peer), unseen.size() == 1 ? " is" : "s are", fmt::join(unseen, ", "),
        current_device());
  }
  return c->peer;
}

Status CudaIpcTransport::establish(const std::shared_ptr<Connection>& c) {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return err::Cancelled("cuda_ipc: transport stopped");
    primary_[c->peer] = c;
    open_.push_back(c);
  }
  ctx_.events->on_peer_up(c->peer);
  return Status::Ok();
}

void CudaIpcTransport::watch(const std::shared_ptr<Connection>& c) {
  // Blocking sends bounded by SO_SNDTIMEO, reads with MSG_DONTWAIT: an
  // O_NONBLOCK socket cut frames larger than its buffer (a 4096-segment
  // COPY_REQ) in half with EAGAIN.
  if (Status s = prepare_control_socket(c->fd); !s.ok()) {
    spdlog::warn("cuda_ipc: {}: {}", describe(*c), s.message());
  }
  {
    std::lock_guard lock(io_mu_);
    watched_[c.get()] = c;
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.ptr = c.get();
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, c->fd, &ev);
}

bool CudaIpcTransport::is_connected(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = primary_.find(peer);
  return it != primary_.end() && !it->second->dead.load();
}

std::string CudaIpcTransport::peer_address(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = primary_.find(peer);
  return it == primary_.end() ? std::string() : "unix:" + it->second->via + it->second->gpu_note;
}

Result<std::shared_ptr<Connection>> CudaIpcTransport::live_connection(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = primary_.find(peer);
  if (it == primary_.end() || it->second->dead.load()) {
    return err::PeerDisconnected(
        fmt::format("cuda_ipc: no live connection to peer {}", hex_id(peer)));
  }
  return it->second;
}

// ---------------------------------------------------------- I/O thread ---

void CudaIpcTransport::io_loop() {
  epoll_event events[64];
  while (!io_stop_.load()) {
    const int n = ::epoll_wait(epfd_, events, 64, 200);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kWakeTag) {
        uint64_t v;
        [[maybe_unused]] auto r = ::read(wakefd_, &v, sizeof v);
        continue;
      }
      if (events[i].data.u64 == kListenTag) {
        on_accept();
        continue;
      }
      std::shared_ptr<Connection> c;
      {
        std::lock_guard lock(io_mu_);
        auto it = watched_.find(static_cast<Connection*>(events[i].data.ptr));
        if (it == watched_.end()) continue;
        c = it->second;
      }
      on_readable(c);
    }
  }
}

void CudaIpcTransport::on_accept() {
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    auto c = std::make_shared<Connection>();
    c->fd = fd;
    c->via = socket_path_;
    unix_socket::set_send_timeout(fd, opt_.send_timeout);
    if (auto pid = unix_socket::peer_pid(fd); pid.ok()) c->pid = *pid;
    watch(c);
  }
}

void CudaIpcTransport::on_readable(const std::shared_ptr<Connection>& c) {
  for (;;) {
    if (c->rx.size() < c->rx_len + kRxChunk) c->rx.resize(c->rx_len + kRxChunk);
    std::vector<int> fds;
    auto r =
        unix_socket::receive(c->fd, std::span<uint8_t>(c->rx.data() + c->rx_len, kRxChunk), &fds);
    for (int d : fds) c->rx_fds.push_back(d);
    Status s;
    if (!r.ok()) {
      s = r.status();
    } else if (*r == 0) {
      s = err::PeerDisconnected("the peer closed the connection");
    } else if (*r < 0) {
      return;  // drained
    } else {
      c->rx_len += static_cast<size_t>(*r);
      if (c->rx_fds.size() > kMaxQueuedFds) {
        s = err::ProtocolError(
            fmt::format("{} descriptors received without a GRANT taking them", c->rx_fds.size()));
      } else {
        s = parse_frames(c);
      }
    }
    if (!s.ok()) {
      fail_connection(*c, s);
      return;
    }
  }
}

Status CudaIpcTransport::parse_frames(const std::shared_ptr<Connection>& c) {
  size_t at = 0;
  while (c->rx_len - at >= kFrameHeaderBytes) {
    auto h = decode_header(ByteView(c->rx.data() + at, kFrameHeaderBytes));
    if (!h.ok()) return h.status();
    if (c->rx_len - at - kFrameHeaderBytes < h->body_bytes) break;
    ByteView body(c->rx.data() + at + kFrameHeaderBytes, h->body_bytes);
    if (Status s = on_frame(c, *h, body); !s.ok()) return s;
    at += kFrameHeaderBytes + h->body_bytes;
    if (c->dead.load()) return Status::Ok();
  }
  if (at > 0) {
    std::memmove(c->rx.data(), c->rx.data() + at, c->rx_len - at);
    c->rx_len -= at;
  }
  return Status::Ok();
}

Status CudaIpcTransport::on_frame(const std::shared_ptr<Connection>& c, const FrameHeader& h,
                                  ByteView body) {
  if (!c->established) {
    if (h.op != Op::kHello) {
      return err::ProtocolError(fmt::format("cuda_ipc: {} before HELLO", op_name(h.op)));
    }
    return on_hello(c, h, body);
  }
  switch (h.op) {
    case Op::kGrantRequest: {
      auto q = decode_grant_request(body);
      if (!q.ok()) return q.status();
      return serve_grant(*c, *q);
    }
    case Op::kGrant:
      return on_grant(*c, body);
    case Op::kFds: {
      auto n = decode_fds(body);
      if (!n.ok()) return n.status();
      if (c->rx_fds.size() < c->announced_fds + *n) {
        return err::ProtocolError(fmt::format("cuda_ipc: FDS announces {} descriptors, {} came", *n,
                                              c->rx_fds.size() - c->announced_fds));
      }
      c->announced_fds += *n;
      return Status::Ok();
    }
    case Op::kRevoke:
      return on_revoke(c, body);
    case Op::kRevokeAck:
      return on_revoke_ack(*c, body);
    case Op::kNotify: {
      ByteReader r(body);
      const uint32_t n = r.u32();
      r.u32();
      if (!r.ok() || n != r.remaining()) {
        return err::ProtocolError("cuda_ipc: NOTIFY length does not match its body");
      }
      auto p = r.bytes(n);
      ctx_.events->on_notification(c->peer, Bytes(p.begin(), p.end()));
      return Status::Ok();
    }
    case Op::kPushExport:
      return on_push_export(*c, body);
    case Op::kCopyRequest: {
      auto q = decode_copy_request(body);
      if (!q.ok()) return q.status();
      return serve_copy(c, *q);
    }
    case Op::kCopyResponse:
      return on_copy_response(*c, body);
    case Op::kHello:
    case Op::kHelloAck:
      break;
  }
  return err::ProtocolError(fmt::format("cuda_ipc: unexpected {}", op_name(h.op)));
}

Status CudaIpcTransport::on_hello(const std::shared_ptr<Connection>& c, const FrameHeader& h,
                                  ByteView body) {
  auto hello = decode_hello(body);
  if (!hello.ok()) return hello.status();
  Status verdict;
  if (h.version != kWireVersion) {
    verdict = err::ProtocolError(
        fmt::format("cuda_ipc: wire version {} of engine {} is not this engine's {}", h.version,
                    hex_id(hello->engine_id), kWireVersion));
  } else if (hello->expected_engine_id != 0 && hello->expected_engine_id != ctx_.engine_id) {
    verdict = err::InvalidArgument(
        fmt::format("cuda_ipc: {} belongs to engine {}, not to engine {} (stale metadata?)",
                    socket_path_, hex_id(ctx_.engine_id), hex_id(hello->expected_engine_id)));
  }
  if (Status s = send_frame(*c, encode_hello_ack({verdict, ctx_.engine_id})); !s.ok()) return s;
  if (!verdict.ok()) return verdict;
  c->peer = hello->engine_id;
  c->established = true;
  return establish(c);
}

Status CudaIpcTransport::serve_grant(Connection& c, const GrantRequest& q) {
  Grant g;
  g.request_id = q.id;
  RegionPin pin;
  std::optional<ExportedMemory> exported;
  const RemoteAccessRequest req{q.region_id, q.adv_offset, q.adv_length, q.key, q.access,
                                0,           q.adv_length};
  auto address = q.access == 0 ? Result<uint8_t*>(err::PermissionDenied("no access requested"))
                               : ctx_.registry->check_remote(req, q.access, &pin);
  if (!address.ok()) {
    g.status = address.status();
  } else if (pin.get()->info.kind != MemoryKind::kCuda) {
    g.status = err::InvalidArgument(fmt::format(
        "cuda_ipc: region {} is host memory; cuda_ipc maps GPU memory only", q.region_id));
  } else {
    auto e = export_memory(*address, q.adv_length);
    if (!e.ok()) {
      g.status = Status(e.status().code(),
                        fmt::format("region {}: {}", q.region_id, e.status().message()));
    } else {
      exported.emplace(std::move(*e));
      const uint64_t id = g.request_id;
      g = exported->grant;
      g.request_id = id;
      g.status = Status::Ok();
    }
  }
  std::lock_guard lock(c.send_mu);
  if (g.status.ok()) {
    auto [it, fresh] = c.exported.try_emplace(q.region_id);
    if (fresh) it->second.pin = std::move(pin);
    const std::vector<int>& fds = exported->fds;
    for (size_t at = 0; at < fds.size(); at += kMaxFdsPerFrame) {
      const size_t n = std::min<size_t>(kMaxFdsPerFrame, fds.size() - at);
      Bytes f = encode_fds(static_cast<uint32_t>(n));
      if (Status s = unix_socket::send_all(c.fd, f, std::span<const int>(fds.data() + at, n));
          !s.ok()) {
        return s;
      }
    }
  }
  return unix_socket::send_all(c.fd, encode_grant(g));
}

Status CudaIpcTransport::on_grant(Connection& c, ByteView body) {
  auto g = decode_grant(body);
  if (!g.ok()) return g.status();
  std::vector<int> fds;
  if (g->status.ok() && g->kind == HandleKind::kVmm) {
    if (c.announced_fds < g->pieces.size()) {
      return err::ProtocolError(
          fmt::format("cuda_ipc: GRANT of {} VMM pieces, {} descriptors "
                      "announced",
                      g->pieces.size(), c.announced_fds));
    }
    for (size_t i = 0; i < g->pieces.size(); ++i) {
      fds.push_back(c.rx_fds.front());
      c.rx_fds.pop_front();
    }
    c.announced_fds -= g->pieces.size();
  }
  std::lock_guard lock(c.mu);
  auto it = c.grant_waits.find(g->request_id);
  if (it == c.grant_waits.end()) {  // the requester gave up
    for (int d : fds) ::close(d);
    return Status::Ok();
  }
  it->second.done = true;
  it->second.grant = std::move(*g);
  it->second.fds = std::move(fds);
  c.cv.notify_all();
  return Status::Ok();
}

Status CudaIpcTransport::on_revoke(const std::shared_ptr<Connection>& c, ByteView body) {
  auto ids = decode_revoke(body);
  if (!ids.ok()) return ids.status();
  PendingRevoke p{c, *ids, {}};
  {
    std::lock_guard lock(c->mu);
    for (auto it = c->grants.begin(); it != c->grants.end();) {
      if (std::find(ids->begin(), ids->end(), std::get<0>(it->first)) != ids->end()) {
        p.grants.push_back(it->second);
        it = c->grants.erase(it);
      } else {
        ++it;
      }
    }
  }
  // The completion thread answers once no copy uses the grants any more.
  {
    std::lock_guard lock(completion_mu_);
    revokes_.push_back(std::move(p));
  }
  wake_completion();
  return Status::Ok();
}

Status CudaIpcTransport::on_revoke_ack(Connection& c, ByteView body) {
  auto ids = decode_revoke(body);
  if (!ids.ok()) return ids.status();
  std::lock_guard lock(c.send_mu);
  for (uint64_t id : *ids) {
    auto it = c.exported.find(id);
    if (it != c.exported.end() && it->second.revoke_sent) c.exported.erase(it);
  }
  return Status::Ok();
}

// ----------------------------------------------------------- initiator ---

Result<std::shared_ptr<ImportedGrant>> CudaIpcTransport::request_grant(
    const std::shared_ptr<Connection>& c, const GrantKey& key, int access_device) {
  GrantRequest q;
  q.id = next_request_id_.fetch_add(1);
  std::tie(q.region_id, q.adv_offset, q.adv_length, q.key, q.access) = key;
  {
    std::lock_guard lock(c->mu);
    c->grant_waits[q.id];
  }
  Status sent = send_frame(*c, encode_grant_request(q));
  Connection::GrantAnswer answer;
  {
    std::unique_lock lock(c->mu);
    const bool got = sent.ok() && c->cv.wait_for(lock, opt_.grant_timeout, [&] {
      return c->grant_waits[q.id].done || c->dead.load();
    });
    answer = std::move(c->grant_waits[q.id]);
    c->grant_waits.erase(q.id);
    if (!sent.ok()) return sent;
    if (!answer.done) {
      for (int d : answer.fds) ::close(d);
      if (c->dead.load()) {
        return err::PeerDisconnected(fmt::format("{} lost while asking for region {}: {}",
                                                 describe(*c), q.region_id, c->dead_reason));
      }
      (void)got;
      return err::Timeout(
          fmt::format("{}: no answer to the grant request for region {} within "
                      "{} ms",
                      describe(*c), q.region_id, opt_.grant_timeout.count()));
    }
  }
  Grant& g = answer.grant;
  if (!g.status.ok()) {
    for (int d : answer.fds) ::close(d);
    return Status(g.status.code(), fmt::format("peer {} refused region {}: {}", hex_id(c->peer),
                                               q.region_id, g.status.message()));
  }
  // One mapping per peer allocation (buffer id), shared by its regions.
  std::shared_ptr<Mapping> mapping;
  {
    std::lock_guard lock(c->mu);
    if (auto it = c->mappings.find(g.buffer_id); it != c->mappings.end() && g.buffer_id != 0) {
      mapping = it->second.lock();
    }
  }
  if (mapping && mapping->length() == g.span_length) {
    for (int d : answer.fds) ::close(d);
  } else {
    auto m = Mapping::import(g, std::move(answer.fds), c->pid == ::getpid(), access_device);
    if (!m.ok()) {
      return Status(m.status().code(), fmt::format("mapping region {} of peer {}: {}", q.region_id,
                                                   hex_id(c->peer), m.status().message()));
    }
    mapping = *m;
    std::lock_guard lock(c->mu);
    c->mappings[g.buffer_id] = mapping;
  }
  auto grant = std::make_shared<ImportedGrant>();
  grant->key = key;
  grant->mapping = mapping;
  grant->address = mapping->base() + (g.region_address - g.span_base);
  grant->length = q.adv_length;
  if (g.region_address - g.span_base > g.span_length ||
      q.adv_length > g.span_length - (g.region_address - g.span_base)) {
    return err::ProtocolError(fmt::format(
        "peer {} granted region {} of {} bytes in a span of {} bytes from offset {}",
        hex_id(c->peer), q.region_id, q.adv_length, g.span_length, g.region_address - g.span_base));
  }
  return grant;
}

Status CudaIpcTransport::acquire_grants(const std::shared_ptr<Connection>& c,
                                        const std::vector<Segment>& segments,
                                        std::vector<ImportedGrant*>* per_segment,
                                        std::vector<std::shared_ptr<ImportedGrant>>* used) {
  per_segment->assign(segments.size(), nullptr);
  for (int round = 0; round < 2; ++round) {
    std::vector<GrantKey> missing;
    std::vector<int> access_device;  // per missing grant: the GPU of its first local block
    {
      std::lock_guard lock(c->mu);
      ImportedGrant* last = nullptr;
      for (size_t i = 0; i < segments.size(); ++i) {
        if ((*per_segment)[i] != nullptr) continue;
        const GrantKey k = key_of(segments[i].remote);
        if (last != nullptr && last->key == k) {
          (*per_segment)[i] = last;
          continue;
        }
        auto it = c->grants.find(k);
        if (it == c->grants.end()) {
          if (std::find(missing.begin(), missing.end(), k) == missing.end()) {
            missing.push_back(k);
            // Local host memory: the process's own GPU, so that its later
            // GPU-memory copies to the same buffer can use the mapping too.
            const int local = segments[i].local_device;
            access_device.push_back(local >= 0 ? local : current_device());
          }
          continue;
        }
        last = it->second.get();
        (*per_segment)[i] = last;
        if (std::find_if(used->begin(), used->end(),
                         [&](const auto& g) { return g.get() == last; }) == used->end()) {
          used->push_back(it->second);
          ++last->in_flight;
        }
      }
    }
    if (missing.empty()) return Status::Ok();
    if (round == 1) break;
    std::lock_guard grant_lock(c->grant_mu);
    for (size_t m = 0; m < missing.size(); ++m) {
      const GrantKey& k = missing[m];
      {
        std::lock_guard lock(c->mu);
        if (c->grants.count(k) != 0) continue;  // another thread got it meanwhile
      }
      auto g = request_grant(c, k, access_device[m]);
      if (!g.ok()) {
        release_grants(*c, *used);
        used->clear();
        return g.status();
      }
      std::lock_guard lock(c->mu);
      c->grants.emplace(k, *g);  // a concurrent request may have won: keep the first
    }
  }
  release_grants(*c, *used);
  used->clear();
  return err::NotFound("cuda_ipc: a region was revoked while its grant was being set up");
}

void CudaIpcTransport::release_grants(Connection& c,
                                      const std::vector<std::shared_ptr<ImportedGrant>>& grants) {
  std::lock_guard lock(c.mu);
  for (const auto& g : grants) --g->in_flight;
}

Result<CudaIpcTransport::StreamSlot*> CudaIpcTransport::slot_for(int device, bool engine_only,
                                                                 bool peer) {
  std::lock_guard lock(slots_mu_);
  for (auto& s : slots_) {
    if (s->device == device && s->engine_only == engine_only && s->peer == peer) return s.get();
  }
  CopyOptions o;
  o.sm_budget = engine_only ? 0 : opt_.sm_budget;
  o.kernel_max_block = peer ? opt_.peer_kernel_max_block : opt_.kernel_max_block;
  o.use_batch_api = !engine_only && opt_.batch_api;
  o.after_default_stream = opt_.after_default_stream;
  auto stream = CopyStream::create(device, o);
  if (!stream.ok()) return stream.status();
  auto slot = std::make_unique<StreamSlot>();
  slot->device = device;
  slot->engine_only = engine_only;
  slot->peer = peer;
  slot->stream = std::move(*stream);
  slots_.push_back(std::move(slot));
  return slots_.back().get();
}

Status CudaIpcTransport::post(PeerId peer, const std::shared_ptr<Transfer>& t,
                              std::vector<Segment>& segments, bool write) {
  if (trace_log_) {
    t->trace = std::make_unique<StageTrace>(trace_log_);
    bool local_gpu = false, remote_gpu = false;
    for (const Segment& s : segments) {
      local_gpu = local_gpu || s.local_device >= 0;
      remote_gpu = remote_gpu || s.remote_device >= 0;
    }
    t->trace->set_memory(local_gpu, remote_gpu);
    t->trace->mark(TraceStage::kPosted);
  }
  auto c = live_connection(peer);
  if (!c.ok()) return c.status();
  // Peer host memory: the target copies (it cannot be mapped here).
  std::vector<Segment> pushed;
  for (const Segment& s : segments) {
    if (s.remote_device < 0) {
      if (s.local_device < 0) {
        return err::NotSupported(fmt::format(
            "cuda_ipc: region {} of peer {} is host memory and so is the local side; shm or "
            "tcp carries host memory",
            s.remote.region_id, hex_id(peer)));
      }
      pushed.push_back(s);
    }
  }
  if (pushed.empty()) return post_granted(*c, t, segments, write, 0);
  std::unique_lock push_lock((*c)->push_mu);
  std::vector<CopyRequest> requests;
  if (Status s = build_copy_requests(**c, pushed, write, &requests); !s.ok()) return s;
  if (pushed.size() != segments.size()) {
    std::vector<Segment> granted;
    for (const Segment& s : segments) {
      if (s.remote_device >= 0) granted.push_back(s);
    }
    if (Status s = post_granted(*c, t, granted, write, requests.size()); !s.ok()) return s;
  } else {
    t->outstanding.store(requests.size());
    if (write && t->has_notification && requests.size() == 1) {
      // One request: the target delivers the notification after its copy.
      requests[0].has_notification = true;
      requests[0].notification = t->notification;
      t->has_notification = false;
    }
  }
  send_copy_requests(**c, t, requests);
  return Status::Ok();
}

Status CudaIpcTransport::post_granted(const std::shared_ptr<Connection>& conn,
                                      const std::shared_ptr<Transfer>& t,
                                      const std::vector<Segment>& segments, bool write,
                                      uint64_t extra) {
  const std::shared_ptr<Connection>* c = &conn;
  std::vector<ImportedGrant*> grant_of;
  std::vector<std::shared_ptr<ImportedGrant>> used;
  if (Status s = acquire_grants(*c, segments, &grant_of, &used); !s.ok()) return s;

  // Group the blocks by the stream that copies them: the local GPU's, or for
  // local host memory the peer memory's GPU (copy-engine only if pageable).
  struct Group {
    StreamSlot* slot = nullptr;
    std::vector<CopyBlock> blocks;
    // Both sides device memory of the slot's GPU: the copy stream need not
    // ask the driver what the pointers are.
    bool device_only = true;
  };
  std::vector<Group> groups;
  Group* last_group = nullptr;  // reassigned after every push_back below
  uint64_t host_lo = 0, host_hi = 0;
  bool host_pageable = false;
  int peer_from = -1, peer_to = -1;  // the last GPU pair with peer access ensured
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    ImportedGrant* g = grant_of[i];
    uint8_t* remote = g->address + s.remote.offset;
    uint8_t* local = s.local;
    uint64_t left = s.length;
    // A local host block is cut where a page-locked allocation ends: PyTorch's
    // pinned-memory allocator hands out blocks that straddle two
    // registrations, and neither the copy kernel nor cudaMemcpyAsync takes
    // one range across both.
    while (left > 0) {
      int device = s.local_device;
      bool engine_only = segments.size() <= opt_.engine_max_blocks;
      uint64_t piece = left;
      bool local_host = false;
      if (device < 0) {
        local_host = true;
        device = g->mapping->host_copy_device();
        const auto a = reinterpret_cast<uint64_t>(local);
        if (a < host_lo || a >= host_hi) {
          auto info = cuda_pointer_info(local);
          host_pageable = !info.ok() || info->type == CudaMemoryType::kPageableHost;
          const bool ranged = info.ok() && info->size != 0 && !host_pageable;
          host_lo = ranged ? info->base : a;
          host_hi = ranged ? info->base + info->size : a + left;
        }
        piece = std::min(left, host_hi - a);
        // Pageable memory: the copy engine, which takes any host memory; the
        // copy kernel needs pinned, mapped memory.
        engine_only = engine_only || host_pageable;
      } else if (!g->mapping->usable_from(device)) {
        // A legacy IPC handle is open in one GPU's context only, the first
        // that used it; CUDA opens a handle once per process.
        release_grants(**c, used);
        return err::NotSupported(fmt::format(
            "cuda_ipc: peer {}'s region {} was mapped for copies from GPU {}; this call copies "
            "from GPU {} (legacy IPC memory is mapped for one GPU of a process; VMM memory, "
            "e.g. PyTorch's expandable segments, for all)",
            hex_id((*c)->peer), std::get<0>(g->key), g->mapping->host_copy_device(), device));
      } else if (g->mapping->device_visible() && device != g->mapping->device() &&
                 (device != peer_from || g->mapping->device() != peer_to)) {
        // Asked once per pair and call: it takes a process-wide lock.
        peer_from = device;
        peer_to = g->mapping->device();
        if (Status st = ensure_peer_access(device, g->mapping->device()); !st.ok()) {
          release_grants(**c, used);
          return st;
        }
      }
      // Local GPU memory to another GPU's: peer access is enabled (above), so
      // the mapping's address is valid in this GPU's kernels too.
      const bool peer = !local_host && device != g->mapping->device();
      Group* group = last_group;
      if (group == nullptr || group->slot->device != device ||
          group->slot->engine_only != engine_only || group->slot->peer != peer) {
        group = nullptr;
        for (Group& x : groups) {
          if (x.slot->device == device && x.slot->engine_only == engine_only &&
              x.slot->peer == peer) {
            group = &x;
          }
        }
      }
      if (group == nullptr) {
        auto slot = slot_for(device, engine_only, peer);
        if (!slot.ok()) {
          release_grants(**c, used);
          return slot.status();
        }
        groups.push_back({*slot, {}, true});
        group = &groups.back();
      }
      // Device memory on both sides, the peer's with peer access enabled: the
      // copy stream need not ask the driver, and its kernel may take the
      // blocks (asked, it would send peer memory to the copy engine, which
      // pays several microseconds per block).
      group->device_only = group->device_only && s.local_device == device;
      last_group = group;
      const CopyBlock b = write ? CopyBlock{remote, local, piece} : CopyBlock{local, remote, piece};
      local += piece;
      remote += piece;
      left -= piece;
      // Blocks adjacent on both sides (consecutive pages of one tensor) become
      // one copy: the copy engine pays a few microseconds per copy, not per
      // byte. Local host memory only within one allocation (see above).
      if (!group->blocks.empty()) {
        CopyBlock& last = group->blocks.back();
        const auto last_local = reinterpret_cast<uint64_t>(write ? last.src : last.dst);
        if (static_cast<uint8_t*>(last.dst) + last.size == b.dst &&
            static_cast<const uint8_t*>(last.src) + last.size == b.src &&
            (!local_host || last_local >= host_lo)) {
          last.size += b.size;
          continue;
        }
      }
      group->blocks.push_back(b);
    }
  }

  t->outstanding.store(groups.size() + extra);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& group = groups[gi];
    StreamSlot& slot = *group.slot;
    // Every group holds each grant once (released as the group finishes).
    std::vector<std::shared_ptr<ImportedGrant>> held = used;
    if (gi > 0) {
      std::lock_guard lock((*c)->mu);
      for (const auto& g : held) ++g->in_flight;
    }
    std::lock_guard lock(slot.mu);
    auto ticket = slot.stream->submit(
        group.blocks, group.device_only ? BlockCheck::kDeviceMemory : BlockCheck::kClassify);
    if (!ticket.ok()) {
      // Groups already submitted finish on their own and report this error;
      // this one and the ones after it never run (and hold no grants).
      release_grants(**c, held);
      t->note_error(ticket.status());
      if (gi == 0) return ticket.status();
      const uint64_t dropped = groups.size() - gi;
      if (t->outstanding.fetch_sub(dropped) == dropped) finish_transfer(**c, t);
      break;
    }
    slot.fifo.push_back(InFlight{t, *c, *ticket, std::move(held)});
    in_flight_.fetch_add(1);
  }
  if (t->trace) t->trace->mark(TraceStage::kStageCopySubmitted);
  wake_completion();
  return Status::Ok();
}

Status CudaIpcTransport::post_write(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                    std::vector<Segment> segments) {
  return post(peer, transfer, segments, true);
}

Status CudaIpcTransport::post_read(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                   std::vector<Segment> segments) {
  return post(peer, transfer, segments, false);
}

Status CudaIpcTransport::post_notification(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                           Bytes payload) {
  auto c = live_connection(peer);
  if (!c.ok()) return c.status();
  if (payload.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes (at most {})", payload.size(),
                                            kMaxNotificationBytes));
  }
  if (Status s = send_frame(**c, encode_notify(payload)); !s.ok()) return s;
  transfer->complete(Status::Ok());
  return Status::Ok();
}

void CudaIpcTransport::cancel(Transfer& transfer) {
  // A copy on the GPU cannot be called back: wait until it is done, so no
  // byte of it moves after this returns.
  std::vector<std::pair<CopyStream*, uint64_t>> waits;
  {
    std::lock_guard lock(slots_mu_);
    for (auto& s : slots_) {
      std::lock_guard slock(s->mu);
      for (const InFlight& f : s->fifo) {
        if (f.transfer.get() == &transfer) waits.emplace_back(s->stream.get(), f.ticket);
      }
    }
  }
  for (auto& [stream, ticket] : waits) {
    if (Status s = stream->wait(ticket, std::chrono::seconds(60)); !s.ok()) {
      spdlog::warn("cuda_ipc: cancelling transfer {}: {}", transfer.id(), s.message());
    }
  }
  // COPY_REQs run on the peer's GPU, reading or writing our memory: wait for
  // their answers (or the peer's death), at most cuda_ipc.grant_timeout_ms.
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard lock(mu_);
    conns = open_;
  }
  for (auto& c : conns) {
    std::unique_lock lock(c->mu);
    const bool idle = c->cv.wait_for(lock, opt_.grant_timeout, [&] {
      if (c->dead.load()) return true;
      for (const auto& [id, t] : c->push_waits) {
        if (t.get() == &transfer) return false;
      }
      return true;
    });
    if (!idle) {
      spdlog::warn("cuda_ipc: cancelling transfer {}: {} has not answered its copy requests",
                   transfer.id(), describe(*c));
    }
  }
  transfer.complete(err::Cancelled(fmt::format("transfer {} cancelled", transfer.id())));
}

// Regions this engine granted and has since revoked: ask their importers to
// let go. Called at once and every 10 ms while a deregistration waits.
void CudaIpcTransport::release_revoked_regions() {
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard lock(mu_);
    conns = open_;
  }
  for (auto& c : conns) {
    std::vector<uint64_t> ids;
    std::lock_guard lock(c->send_mu);
    for (auto& [id, e] : c->exported) {
      if (!e.revoke_sent && e.pin.get() != nullptr && e.pin.get()->revoked.load()) {
        e.revoke_sent = true;
        e.revoke_deadline = Clock::now() + opt_.revoke_timeout;
        ids.push_back(id);
      }
    }
    if (ids.empty() || c->dead.load()) continue;
    if (Status s = unix_socket::send_all(c->fd, encode_revoke(Op::kRevoke, ids)); !s.ok()) {
      ::shutdown(c->fd, SHUT_RDWR);  // the I/O thread fails it and drops the pins
    }
  }
  wake_completion();
}

// ------------------------------------ local GPU with peer host memory ---

// Under c.push_mu. Each segment's local GPU range is named as (export id,
// offset): an export already sent on this connection whose allocation is
// still the same (buffer id), else a new PUSH_EXPORT of the registered region.
Status CudaIpcTransport::build_copy_requests(Connection& c, const std::vector<Segment>& segments,
                                             bool write, std::vector<CopyRequest>* out) {
  std::vector<uint64_t> checked;  // export ids whose allocation was verified in this call
  std::vector<int> synced;        // devices whose default stream was waited for
  const Connection::LocalExport* last = nullptr;
  out->clear();
  for (const Segment& s : segments) {
    const auto a = reinterpret_cast<uint64_t>(s.local);
    auto covers = [&](const Connection::LocalExport& e) {
      return a >= e.span_base && a - e.span_base <= e.span_length &&
             s.length <= e.span_length - (a - e.span_base);
    };
    if (last == nullptr || !covers(*last)) {
      last = nullptr;
      for (auto it = c.local_exports.begin(); it != c.local_exports.end(); ++it) {
        if (!covers(*it)) continue;
        if (std::find(checked.begin(), checked.end(), it->id) == checked.end()) {
          // Freed and allocated again since it was exported: export afresh.
          auto info = cuda_pointer_info(reinterpret_cast<const void*>(it->check_address));
          if (!info.ok() || info->buffer_id != it->buffer_id) {
            c.local_exports.erase(it);
            break;
          }
          checked.push_back(it->id);
        }
        last = &*it;
        break;
      }
    }
    if (last == nullptr) {
      auto region = ctx_.registry->find_local(s.local, s.length);
      if (!region.ok()) return region.status();
      auto e = export_memory(region->address, region->length);
      if (!e.ok()) {
        return Status(e.status().code(),
                      fmt::format("cuda_ipc: exporting local GPU memory at {} "
                                  "for peer {}: {}",
                                  region->address, hex_id(c.peer), e.status().message()));
      }
      Connection::LocalExport le;
      le.id = c.next_export_id++;
      le.buffer_id = e->grant.buffer_id;
      le.check_address = e->grant.region_address;
      le.span_base = e->grant.span_base;
      le.span_length = e->grant.span_length;
      // The target drops every older export this one overlaps (see
      // on_push_export); mirror that here so no request names one.
      std::erase_if(c.local_exports, [&](const Connection::LocalExport& o) {
        return o.span_base < le.span_base + le.span_length &&
               le.span_base < o.span_base + o.span_length;
      });
      Status sent;
      {
        std::lock_guard lock(c.send_mu);
        const std::vector<int>& fds = e->fds;
        for (size_t at = 0; at < fds.size() && sent.ok(); at += kMaxFdsPerFrame) {
          const size_t n = std::min<size_t>(kMaxFdsPerFrame, fds.size() - at);
          sent = unix_socket::send_all(c.fd, encode_fds(static_cast<uint32_t>(n)),
                                       std::span<const int>(fds.data() + at, n));
        }
        if (sent.ok()) {
          sent = unix_socket::send_all(c.fd, encode_push_export({le.id, e->grant}));
        }
      }
      if (!sent.ok()) {
        sent = Status(sent.code(), fmt::format("{}: sending PUSH_EXPORT {}: {}", describe(c), le.id,
                                               sent.message()));
        // Part of a frame may be on the wire (see send_frame): the connection
        // cannot go on.
        fail_connection(c, sent);
        return sent;
      }
      c.local_exports.push_back(le);
      last = &c.local_exports.back();
      checked.push_back(le.id);
      if (!covers(*last)) {
        return err::Internal(fmt::format(
            "cuda_ipc: the export of local GPU memory [{:#x}, +{}) does not cover [{:#x}, +{})",
            le.span_base, le.span_length, a, s.length));
      }
    }
    // The peer's copy cannot be ordered after our default stream on the GPU.
    if (opt_.after_default_stream &&
        std::find(synced.begin(), synced.end(), s.local_device) == synced.end()) {
      if (Status st = sync_default_stream(s.local_device); !st.ok()) return st;
      synced.push_back(s.local_device);
    }
    if (out->empty() || out->back().segments.size() == kMaxCopySegments) {
      CopyRequest q;
      q.direction = write ? CopyDirection::kWrite : CopyDirection::kRead;
      out->push_back(std::move(q));
    }
    out->back().segments.push_back({s.remote, last->id, a - last->span_base});
  }
  return Status::Ok();
}

// Under c.push_mu; t->outstanding already counts every request.
void CudaIpcTransport::send_copy_requests(Connection& c, const std::shared_ptr<Transfer>& t,
                                          std::vector<CopyRequest>& requests) {
  for (CopyRequest& q : requests) {
    q.id = next_request_id_.fetch_add(1);
    bool registered = false;
    {
      std::lock_guard lock(c.mu);
      if (!c.dead.load()) {
        c.push_waits.emplace(q.id, t);
        registered = true;
      }
    }
    Status sent = registered ? send_frame(c, encode_copy_request(q))
                             : err::PeerDisconnected(fmt::format("{} is closed", describe(c)));
    if (sent.ok()) continue;
    // Whoever takes the request out of push_waits counts it (here, or
    // fail_connection when the connection died meanwhile).
    bool mine = !registered;
    if (registered) {
      std::lock_guard lock(c.mu);
      mine = c.push_waits.erase(q.id) != 0;
    }
    if (mine) {
      t->note_error(sent);
      if (t->outstanding.fetch_sub(1) == 1) finish_transfer(c, t);
    }
  }
}

Status CudaIpcTransport::on_copy_response(Connection& c, ByteView body) {
  auto a = decode_copy_response(body);
  if (!a.ok()) return a.status();
  std::shared_ptr<Transfer> t;
  {
    std::lock_guard lock(c.mu);
    auto it = c.push_waits.find(a->request_id);
    if (it == c.push_waits.end()) {
      return err::ProtocolError(
          fmt::format("cuda_ipc: COPY_RESP for request {}, which is not waiting", a->request_id));
    }
    t = std::move(it->second);
    c.push_waits.erase(it);
    c.cv.notify_all();
  }
  if (!a->status.ok()) {
    t->note_error(Status(a->status.code(), fmt::format("peer {} refused the copy: {}",
                                                       hex_id(c.peer), a->status.message())));
  }
  if (t->outstanding.fetch_sub(1) == 1) finish_transfer(c, t);
  return Status::Ok();
}

// The initiator's GPU allocation, mapped here. A mapping that fails is kept
// as its error: requests naming it are refused with that reason.
Status CudaIpcTransport::on_push_export(Connection& c, ByteView body) {
  auto e = decode_push_export(body);
  if (!e.ok()) return e.status();
  std::vector<int> fds;
  if (e->grant.kind == HandleKind::kVmm) {
    if (c.announced_fds < e->grant.pieces.size()) {
      return err::ProtocolError(
          fmt::format("cuda_ipc: PUSH_EXPORT of {} VMM pieces, {} descriptors announced",
                      e->grant.pieces.size(), c.announced_fds));
    }
    for (size_t i = 0; i < e->grant.pieces.size(); ++i) {
      fds.push_back(c.rx_fds.front());
      c.rx_fds.pop_front();
    }
    c.announced_fds -= e->grant.pieces.size();
  }
  if (c.peer_exports.count(e->export_id) != 0) {
    for (int d : fds) ::close(d);
    return err::ProtocolError(fmt::format("cuda_ipc: PUSH_EXPORT {} sent twice", e->export_id));
  }
  // An older export overlapping this one is an allocation the initiator freed
  // (live allocations do not overlap): drop it. Copies using it hold their
  // own reference, and the initiator never names it again.
  const uint64_t lo = e->grant.span_base, hi = e->grant.span_base + e->grant.span_length;
  std::erase_if(c.peer_exports, [&](const auto& kv) {
    return kv.second.span_base < hi && lo < kv.second.span_base + kv.second.span_length;
  });
  if (c.peer_exports.size() >= kMaxPieces) {
    for (int d : fds) ::close(d);
    return err::ProtocolError(
        fmt::format("cuda_ipc: {} exports from one peer at once", c.peer_exports.size()));
  }
  Connection::PeerExport pe;
  pe.span_base = e->grant.span_base;
  pe.span_length = e->grant.span_length;
  auto m = Mapping::import(e->grant, std::move(fds), c.pid == ::getpid());
  if (m.ok()) {
    pe.mapping = *m;
  } else {
    pe.error = m.status();
    spdlog::warn("cuda_ipc: {}: cannot map its export {}: {}", describe(c), e->export_id,
                 m.status().message());
  }
  c.peer_exports.emplace(e->export_id, std::move(pe));
  return Status::Ok();
}

// A COPY_REQ: every segment checked as tcp and shm check an operation (region,
// key, range, access); one refusal and nothing moves. Then one CopyStream
// batch per stream, answered from the completion thread.
Status CudaIpcTransport::serve_copy(const std::shared_ptr<Connection>& c, CopyRequest& q) {
  const bool write = q.direction == CopyDirection::kWrite;
  const uint8_t wanted = write ? kAccessWrite : kAccessRead;
  auto sv = std::make_shared<Served>();
  sv->conn = c;
  sv->request_id = q.id;
  sv->has_notification = q.has_notification;
  sv->notification = std::move(q.notification);
  struct Group {
    StreamSlot* slot = nullptr;
    std::vector<CopyBlock> blocks;
  };
  std::vector<Group> groups;
  Status verdict;
  uint64_t host_lo = 0, host_hi = 0;
  bool host_pageable = false;
  const Mapping* last_mapping = nullptr;
  for (size_t i = 0; i < q.segments.size() && verdict.ok(); ++i) {
    const CopySegment& seg = q.segments[i];
    RegionPin pin;
    auto address = ctx_.registry->check_remote(seg.remote, wanted, &pin);
    if (!address.ok()) {
      verdict = Status(address.status().code(),
                       fmt::format("segment {}: {}", i, address.status().message()));
      break;
    }
    if (pin.get()->info.kind != MemoryKind::kHost) {
      verdict = err::InvalidArgument(
          fmt::format("segment {}: region {} is GPU memory; a copy request names host memory", i,
                      seg.remote.region_id));
      break;
    }
    auto pe = c->peer_exports.find(seg.export_id);
    if (pe == c->peer_exports.end() || !pe->second.mapping) {
      verdict =
          pe == c->peer_exports.end()
              ? err::InvalidArgument(fmt::format(
                    "segment {}: export {} of the initiator is unknown here", i, seg.export_id))
              : Status(pe->second.error.code(),
                       fmt::format("segment {}: export {} could not be mapped here: {}", i,
                                   seg.export_id, pe->second.error.message()));
      break;
    }
    const std::shared_ptr<Mapping>& mapping = pe->second.mapping;
    if (seg.export_offset > pe->second.span_length ||
        seg.remote.length > pe->second.span_length - seg.export_offset) {
      verdict = err::OutOfRange(
          fmt::format("segment {}: [{}, +{}) is outside the {} bytes of export {}", i,
                      seg.export_offset, seg.remote.length, pe->second.span_length, seg.export_id));
      break;
    }
    if (sv->pins.empty() || sv->pins.back().get() != pin.get()) sv->pins.push_back(std::move(pin));
    if (mapping.get() != last_mapping) {
      sv->mappings.push_back(mapping);
      last_mapping = mapping.get();
    }
    uint8_t* host = *address;
    uint8_t* gpu = mapping->base() + seg.export_offset;
    uint64_t left = seg.remote.length;
    // Memory on a GPU this process does not see is copied by the GPU that
    // mapped it.
    const int device = mapping->host_copy_device();
    // Host blocks are cut where a page-locked allocation ends (see post());
    // pageable memory goes to the copy engine, which the kernel cannot read.
    while (left > 0) {
      const auto a = reinterpret_cast<uint64_t>(host);
      if (a < host_lo || a >= host_hi) {
        auto info = cuda_pointer_info(host);
        host_pageable = !info.ok() || info->type == CudaMemoryType::kPageableHost;
        const bool ranged = info.ok() && info->size != 0 && !host_pageable;
        host_lo = ranged ? info->base : a;
        host_hi = ranged ? info->base + info->size : a + left;
      }
      const uint64_t piece = std::min(left, host_hi - a);
      const bool engine_only = host_pageable || q.segments.size() <= opt_.engine_max_blocks;
      Group* group = nullptr;
      for (Group& x : groups) {
        if (x.slot->device == device && x.slot->engine_only == engine_only && !x.slot->peer) {
          group = &x;
        }
      }
      if (group == nullptr) {
        auto slot = slot_for(device, engine_only, false);
        if (!slot.ok()) {
          verdict = slot.status();
          break;
        }
        groups.push_back({*slot, {}});
        group = &groups.back();
      }
      const CopyBlock b = write ? CopyBlock{host, gpu, piece} : CopyBlock{gpu, host, piece};
      host += piece;
      gpu += piece;
      left -= piece;
      if (!group->blocks.empty()) {
        CopyBlock& l = group->blocks.back();
        const auto last_host = reinterpret_cast<uint64_t>(write ? l.dst : l.src);
        if (static_cast<uint8_t*>(l.dst) + l.size == b.dst &&
            static_cast<const uint8_t*>(l.src) + l.size == b.src && last_host >= host_lo) {
          l.size += b.size;
          continue;
        }
      }
      group->blocks.push_back(b);
    }
  }
  if (!verdict.ok()) {
    sv->pins.clear();
    return send_frame(*c, encode_copy_response({q.id, verdict}));
  }
  sv->outstanding.store(static_cast<uint32_t>(groups.size()));
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    StreamSlot& slot = *groups[gi].slot;
    std::unique_lock lock(slot.mu);
    auto ticket = slot.stream->submit(groups[gi].blocks, BlockCheck::kClassify);
    if (!ticket.ok()) {
      lock.unlock();
      {
        std::lock_guard elock(sv->mu);
        if (sv->error.ok()) sv->error = ticket.status();
      }
      // This group and the ones after it never run.
      const auto dropped = static_cast<uint32_t>(groups.size() - gi);
      if (sv->outstanding.fetch_sub(dropped) == dropped) finish_served(*sv);
      break;
    }
    slot.fifo.push_back(InFlight{nullptr, c, *ticket, {}, sv});
    in_flight_.fetch_add(1);
  }
  wake_completion();
  return Status::Ok();
}

// ---------------------------------------------------- completion thread ---

void CudaIpcTransport::wake_completion() {
  { std::lock_guard lock(completion_mu_); }
  completion_cv_.notify_one();
}

bool CudaIpcTransport::reap(bool check_failures) {
  thread_local std::vector<InFlight> done;
  {
    std::lock_guard lock(slots_mu_);
    for (auto& slot : slots_) {
      StreamSlot* s = slot.get();
      std::lock_guard slock(s->mu);
      if (s->fifo.empty()) continue;
      const uint64_t through = s->stream->completed_through();
      while (!s->fifo.empty() && s->fifo.front().ticket <= through) {
        done.push_back(std::move(s->fifo.front()));
        s->fifo.pop_front();
      }
      if (check_failures && !s->fifo.empty()) {
        // A failed stream fails what waits on it.
        Status st = s->stream->poll(s->fifo.front().ticket);
        if (!st.ok() && st.code() != StatusCode::kInProgress) {
          while (!s->fifo.empty()) {
            done.push_back(std::move(s->fifo.front()));
            s->fifo.pop_front();
            InFlight& f = done.back();
            if (f.transfer) {
              f.transfer->note_error(st);
            } else {
              std::lock_guard flock(f.served->mu);
              if (f.served->error.ok()) f.served->error = st;
            }
          }
        }
      }
    }
  }
  const bool any = !done.empty();
  for (InFlight& f : done) {
    in_flight_.fetch_sub(1);
    finish_group(f, Status::Ok());
  }
  done.clear();
  return any;
}

void CudaIpcTransport::progress(const Transfer& transfer) {
  if (!opt_.waiter_polls || transfer.finished() ||
      in_flight_.load(std::memory_order_relaxed) == 0) {
    return;
  }
  // The waiting thread polls the streams itself: no hand-over from the
  // completion thread, which stands aside while a waiter was here recently.
  last_waiter_poll_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  std::unique_lock lock(reap_mu_, std::try_to_lock);
  if (lock.owns_lock()) reap(false);
}

void CudaIpcTransport::completion_loop() {
  auto next_housekeeping = Clock::now();
  auto next_failure_check = Clock::now();
  auto linger_until = Clock::now();
  for (;;) {
    {
      std::unique_lock lock(completion_mu_);
      if (completion_stop_) return;
      if (in_flight_.load() == 0 && revokes_.empty() && Clock::now() >= linger_until) {
        completion_cv_.wait_for(lock, std::chrono::milliseconds(50), [&] {
          return completion_stop_ || in_flight_.load() != 0 || !revokes_.empty();
        });
        if (completion_stop_) return;
      }
    }
    const auto now = Clock::now();
    const bool waiter_polls =
        now.time_since_epoch().count() - last_waiter_poll_.load(std::memory_order_relaxed) <
        std::chrono::duration_cast<Clock::duration>(std::chrono::microseconds(20)).count();
    if (in_flight_.load() != 0) linger_until = now + opt_.poll_linger;
    if (!waiter_polls || now >= next_failure_check) {
      const bool check = now >= next_failure_check;
      if (check) next_failure_check = now + std::chrono::milliseconds(1);
      std::lock_guard lock(reap_mu_);
      if (reap(check)) linger_until = Clock::now() + opt_.poll_linger;
    } else {
      cpu_relax_for_a_moment();
    }
    const bool revokes_waiting = process_revokes();
    if (now >= next_housekeeping) {
      enforce_revoke_deadlines();
      next_housekeeping = now + std::chrono::milliseconds(20);
    }
    if (in_flight_.load() == 0 && revokes_waiting) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

void CudaIpcTransport::finish_group(InFlight& f, const Status& status) {
  if (f.served) {
    if (!status.ok()) {
      std::lock_guard lock(f.served->mu);
      if (f.served->error.ok()) f.served->error = status;
    }
    if (f.served->outstanding.fetch_sub(1) == 1) finish_served(*f.served);
    f.served.reset();
    return;
  }
  release_grants(*f.conn, f.grants);
  f.grants.clear();
  if (f.transfer->trace) f.transfer->trace->mark(TraceStage::kStageCopyDone);
  if (!status.ok()) f.transfer->note_error(status);
  if (f.transfer->outstanding.fetch_sub(1) == 1) finish_transfer(*f.conn, f.transfer);
}

void CudaIpcTransport::finish_transfer(Connection& c, const std::shared_ptr<Transfer>& t) {
  Status s = t->first_error();
  if (s.ok() && c.dead.load()) {
    std::lock_guard lock(c.mu);
    s = err::PeerDisconnected(fmt::format("{} was lost: {}", describe(c), c.dead_reason));
  }
  if (s.ok() && t->op() == TransferOp::kWrite && t->has_notification) {
    // The data is in the peer's memory: the notification may follow.
    s = send_frame(c, encode_notify(t->notification));
  }
  t->complete(s);
}

// A served COPY_REQ's copies are done: the notification (a write's, carried
// by the request) goes to the application first, then the answer.
void CudaIpcTransport::finish_served(Served& sv) {
  Status status;
  {
    std::lock_guard lock(sv.mu);
    status = sv.error;
  }
  if (status.ok() && sv.has_notification) {
    ctx_.events->on_notification(sv.conn->peer, std::move(sv.notification));
  }
  sv.mappings.clear();
  sv.pins.clear();  // deregistration may proceed
  if (sv.conn->dead.load()) return;
  if (Status s = send_frame(*sv.conn, encode_copy_response({sv.request_id, status})); !s.ok()) {
    fail_connection(*sv.conn, s);
  }
}

// Answers REVOKEs whose grants no copy uses any more; true while some wait.
bool CudaIpcTransport::process_revokes() {
  std::vector<PendingRevoke> ready;
  bool waiting = false;
  {
    std::lock_guard lock(completion_mu_);
    for (auto it = revokes_.begin(); it != revokes_.end();) {
      bool idle = true;
      {
        std::lock_guard clock(it->conn->mu);
        for (const auto& g : it->grants) idle = idle && g->in_flight == 0;
      }
      if (idle) {
        ready.push_back(std::move(*it));
        it = revokes_.erase(it);
      } else {
        waiting = true;
        ++it;
      }
    }
  }
  for (PendingRevoke& p : ready) {
    p.grants.clear();  // unmaps where this was the last use of the mapping
    if (!p.conn->dead.load()) {
      if (Status s = send_frame(*p.conn, encode_revoke(Op::kRevokeAck, p.region_ids)); !s.ok()) {
        fail_connection(*p.conn, s);
      }
    }
  }
  return waiting;
}

void CudaIpcTransport::enforce_revoke_deadlines() {
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard lock(mu_);
    conns = open_;
  }
  const auto now = Clock::now();
  for (auto& c : conns) {
    RegionId late = 0;
    {
      std::lock_guard lock(c->send_mu);
      for (auto& [id, e] : c->exported) {
        if (e.revoke_sent && now >= e.revoke_deadline) late = id;
      }
    }
    if (late != 0) {
      spdlog::warn(
          "cuda_ipc: {} did not release deregistered region {} within {} ms; closing "
          "the connection",
          describe(*c), late, opt_.revoke_timeout.count());
      fail_connection(*c, err::Timeout(fmt::format(
                              "the peer did not release deregistered region {} within {} ms", late,
                              opt_.revoke_timeout.count())));
    }
  }
}

// ---------------------------------------------------------------- both ---

Status CudaIpcTransport::send_frame(Connection& c, const Bytes& frame, std::span<const int> fds) {
  if (c.dead.load()) {
    return err::PeerDisconnected(fmt::format("{} is closed", describe(c)));
  }
  Status s;
  {
    std::lock_guard lock(c.send_mu);
    s = unix_socket::send_all(c.fd, frame, fds);
  }
  if (!s.ok()) {
    s = Status(s.code(), fmt::format("{}: sending {} of {} bytes: {}", describe(c),
                                     frame_op_name(frame), frame.size(), s.message()));
    // Part of the frame may be on the wire: the peer would read the next
    // frame as the rest of this one. The connection cannot go on.
    fail_connection(c, s);
  }
  return s;
}

void CudaIpcTransport::fail_connection(Connection& c, const Status& reason) {
  if (c.dead.exchange(true)) return;
  ::shutdown(c.fd, SHUT_RDWR);
  std::unordered_map<uint64_t, std::shared_ptr<Transfer>> pushed;
  {
    std::lock_guard lock(c.mu);
    c.dead_reason = reason.message();
    pushed.swap(c.push_waits);
    c.cv.notify_all();
  }
  // COPY_REQs the peer will never answer.
  for (auto& [id, t] : pushed) {
    t->note_error(err::PeerDisconnected(fmt::format(
        "{} was lost before it answered copy request {}: {}", describe(c), id, reason.message())));
    if (t->outstanding.fetch_sub(1) == 1) finish_transfer(c, t);
  }
  {
    // Pins of what this peer mapped: it can no longer use them (its process
    // is gone or is being cut off), so deregistration need not wait.
    std::lock_guard lock(c.send_mu);
    c.exported.clear();
  }
  std::shared_ptr<Connection> self;
  bool was_primary = false;
  {
    std::lock_guard lock(io_mu_);
    if (auto it = watched_.find(&c); it != watched_.end()) {
      self = it->second;
      watched_.erase(it);
      ::epoll_ctl(epfd_, EPOLL_CTL_DEL, c.fd, nullptr);
    }
  }
  {
    std::lock_guard lock(mu_);
    open_.erase(
        std::remove_if(open_.begin(), open_.end(), [&](const auto& p) { return p.get() == &c; }),
        open_.end());
    if (auto it = primary_.find(c.peer); it != primary_.end() && it->second.get() == &c) {
      primary_.erase(it);
      was_primary = true;
      // Another open connection to the same peer takes over.
      for (auto& o : open_) {
        if (o->peer == c.peer && !o->dead.load()) {
          primary_[c.peer] = o;
          was_primary = false;
          break;
        }
      }
    }
  }
  if (was_primary && c.established) {
    spdlog::info("cuda_ipc: {} closed: {}", describe(c), reason.message());
    ctx_.events->on_peer_down(c.peer, err::PeerDisconnected(reason.message()));
  }
}

}  // namespace ferry::cuda_ipc
