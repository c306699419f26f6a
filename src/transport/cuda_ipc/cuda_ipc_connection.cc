// cuda_ipc transport: connecting and the handshake, the peer table,
// sending frames and failing a connection.
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/common/unix_socket.h"
#include "transport/cuda_ipc/cuda_ipc_internal.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"

namespace ferry::cuda_ipc {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

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
