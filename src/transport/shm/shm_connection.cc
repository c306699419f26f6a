// shm transport: connecting and the handshake (both sides, the cross-memory
// attach probe and the choice of mode), the peer table, sending a frame and
// failing a connection.
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
#include "transport/shm/shm_internal.h"
#include "transport/shm/shm_transport.h"

namespace ferry::shm {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

// Descriptors that arrived with SCM_RIGHTS, closed unless taken.
struct ReceivedFds {
  ~ReceivedFds() { close_all(); }
  void close_all() {
    for (int fd : fds) ::close(fd);
    fds.clear();
  }
  std::vector<int> fds;
};

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

// Sends `frame` with descriptors `pass` (those >= 0, at most two, in order)
// attached to its first byte (SCM_RIGHTS). Whole or an error: handshake
// frames are small and go first on their socket.
ssize_t send_frame_fd(int fd, const Bytes& frame, int pass, int pass2 = -1) {
  iovec iov{const_cast<uint8_t*>(frame.data()), frame.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
  int fds[2];
  int count = 0;
  if (pass >= 0) fds[count++] = pass;
  if (pass2 >= 0) fds[count++] = pass2;
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (count > 0) {
    m.msg_control = control;
    m.msg_controllen = CMSG_SPACE(count * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(count * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds, count * sizeof(int));
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

}  // namespace

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
  // Request rings where both engines take them (our ring rides on the
  // HELLO_DONE, after the area if there is one; the peer's comes in a RING).
  if (opt_.request_ring && (ack->features & kFeatureRequestRing) != 0) {
    if (Status r = make_ring_out(c); r.ok()) {
      done->request_ring = true;
    } else {
      spdlog::warn("ferry shm: no request ring for {}: {}; small requests go on the socket", where,
                   r.message());
    }
  }
  const Bytes frame = encode_hello_done(*done);
  const ssize_t sent =
      send_frame_fd(c.fd, frame, c.stages_gpu() ? c.own.fd() : -1, c.rings ? c.ring_out.fd() : -1);
  if (sent != static_cast<ssize_t>(frame.size())) {
    return lost(err::PeerDisconnected(fmt::format(
        "sending HELLO_DONE failed: {}",
        sent < 0 ? errno_text(errno) : fmt::format("{} of {} bytes", sent, frame.size()))));
  }
  c.own.close_fd();
  c.ring_out.close_fd();
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

constexpr const char* kCmaWithGpuAreas =
    "cross-memory attach; GPU memory staged through shared host memory";

std::string area_name(uint64_t engine, uint64_t peer) {
  return fmt::format("ferry-shm-{:016x}-to-{:016x}", engine, peer);
}

// Staging mode copies through both areas from the first request on: their
// pages are backed now (StagingArea::populate).
Status populate_areas(const Connection& c) {
  if (Status s = c.own.populate("this engine's staging area"); !s.ok()) return s;
  return c.theirs.populate("the peer's staging area");
}

// The connecting side's two areas: the peer's (its descriptor `fd`, `their_bytes`
// long) mapped, ours created, and the ring over ours.
Status take_areas(Connection& c, int fd, uint64_t their_bytes, uint64_t own_bytes,
                  uint64_t engine) {
  auto theirs = StagingArea::adopt(fd, their_bytes);
  if (!theirs.ok()) return theirs.status();
  auto own = StagingArea::create(own_bytes, area_name(engine, c.peer));
  if (!own.ok()) return own.status();
  c.theirs = std::move(theirs.value());
  c.own = std::move(own.value());
  c.ring = StagingRing(c.own.size());
  return Status::Ok();
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
    c.mode_text = "cross-memory attach";
    done.mode = Mode::kCma;
    // Kept only where this process can copy GPU memory: elsewhere host
    // memory behaves exactly as before.
    if (cuda_here_ && (ack.features & kFeatureGpuAreas) != 0 && ack.staging_bytes > 0 &&
        fds.size() == 1) {
      // Both areas stay, for GPU memory; host memory goes by cross-memory attach.
      const int fd = fds.front();
      fds.clear();
      if (Status s = take_areas(c, fd, ack.staging_bytes, opt_.staging_bytes, ctx_.engine_id);
          !s.ok()) {
        return s;
      }
      c.gpu_areas = true;
      c.mode_text = kCmaWithGpuAreas;
      done.staging_bytes = c.own.size();
      return done;
    }
    for (int fd : fds) ::close(fd);  // the area offered in case we needed it
    fds.clear();
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
  if (Status s = take_areas(c, fd, ack.staging_bytes, opt_.staging_bytes, ctx_.engine_id);
      !s.ok()) {
    return s;
  }
  if (Status s = populate_areas(c); !s.ok()) return s;
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
  if (c->rings) {
    std::lock_guard lock(io_mu_);
    ring_conns_.push_back(c);
    ring_conns_gen_.fetch_add(1, std::memory_order_release);
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
      // The connecting engine may keep both areas in cross-memory attach
      // mode too, for GPU memory.
      if (opt_.gpu_areas) ack.features = kFeatureGpuAreas;
    } else if (forced_staging || !c.cma_refusal.empty()) {
      return refuse(own.status());
    } else {
      spdlog::warn("ferry shm: no staging area for {}: {}; only cross-memory attach can serve it",
                   describe(c), own.status().message());
    }
  }
  if (opt_.request_ring) ack.features |= kFeatureRequestRing;
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
  if (done->request_ring) {
    // Its ring is the last descriptor of the frame (after its area).
    if (!opt_.request_ring || c.rx_fds.empty()) {
      return err::ProtocolError(fmt::format(
          "{} chose request rings, but {}", who,
          !opt_.request_ring ? std::string("this engine did not offer them (shm.request_ring)")
                             : std::string("its HELLO_DONE carries no ring")));
    }
    const int fd = c.rx_fds.back();
    c.rx_fds.pop_back();
    auto ring = RequestRing::adopt(fd, kRingBytes);
    if (!ring.ok()) {
      return Status(ring.status().code(), fmt::format("{}: {}", who, ring.status().message()));
    }
    if (Status r = make_ring_out(c); !r.ok()) return r;
    c.ring_in = std::move(ring.value());
    c.ring_in_ready.store(true, std::memory_order_release);
  } else if (c.rx_fds.size() > 1) {
    return err::ProtocolError(
        fmt::format("{} sent {} descriptors on its HELLO_DONE", who, c.rx_fds.size()));
  }
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
    if (Status s = populate_areas(c); !s.ok()) return s;
    c.staged = true;
    const std::string refusal =
        !c.cma_refusal.empty() || done->cma_refusal.empty()
            ? c.cma_refusal
            : fmt::format("the peer's probe of this process: {}",
                          std::string_view(done->cma_refusal)
                              .substr(done->cma_refusal.starts_with("shm: ") ? 5 : 0));
    c.mode_text = staging_text(opt_.mode, c.peer_mode, refusal);
  } else {
    // An area on a cma HELLO_DONE: both areas stay, for GPU memory -- only
    // if we offered that (kFeatureGpuAreas).
    const bool gpu_areas = !c.rx_fds.empty() || done->staging_bytes > 0;
    if (opt_.mode == Mode::kStaging || !c.cma_refusal.empty() ||
        (gpu_areas && (!opt_.gpu_areas || !c.own.valid()))) {
      return err::ProtocolError(
          fmt::format("{} chose cross-memory attach, but {}", who,
                      opt_.mode == Mode::kStaging ? "this engine runs with shm.mode=staging"
                      : !c.cma_refusal.empty()
                          ? fmt::format("this engine's probe of it failed: {}", c.cma_refusal)
                          : std::string("its HELLO_DONE carries a staging area this engine did "
                                        "not ask for (no kFeatureGpuAreas)")));
    }
    if (gpu_areas) {
      if (c.rx_fds.size() != 1 || done->staging_bytes == 0) {
        return err::ProtocolError(fmt::format(
            "{} kept GPU staging areas with {} descriptor(s) and an area of {} bytes on its "
            "HELLO_DONE, expected one area",
            who, c.rx_fds.size(), done->staging_bytes));
      }
      const int fd = c.rx_fds.front();
      c.rx_fds.clear();
      auto theirs = StagingArea::adopt(fd, done->staging_bytes);
      if (!theirs.ok()) {
        return Status(theirs.status().code(),
                      fmt::format("{}: {}", who, theirs.status().message()));
      }
      c.theirs = std::move(theirs.value());
      c.own.close_fd();
      c.ring = StagingRing(c.own.size());
      c.gpu_areas = true;
      c.mode_text = kCmaWithGpuAreas;
    } else {
      c.own.reset();
      c.mode_text = "cross-memory attach";
    }
  }
  if (c.rings) {
    // Ours, for the requests we initiate: before any of them.
    if (Status r = send_now(c.fd, encode_ring(kRingBytes), c.ring_out.fd()); !r.ok()) return r;
    c.ring_out.close_fd();
  }
  c.state = Connection::State::kOpen;
  return establish(c.shared_from_this());
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
  if (c.rings) {
    std::lock_guard lock(io_mu_);
    std::erase_if(ring_conns_, [&](const std::shared_ptr<Connection>& o) { return o.get() == &c; });
    ring_conns_gen_.fetch_add(1, std::memory_order_release);
  }
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
