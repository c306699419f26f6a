// shm transport: the I/O thread -- its epoll loop, accepting connections,
// reading the control sockets and dispatching their frames.
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

constexpr size_t kRxInitialBytes = 256 << 10;

// Descriptors the peer may have sent by now: a HELLO_DONE's area and
// request ring; the peer's request ring (RING) once open, until mapped.
size_t max_fds(const Connection& c) {
  if (c.state != Connection::State::kOpen) return 2;
  return c.rings && !c.ring_in_ready.load() ? 1 : 0;
}

}  // namespace

// ------------------------------------------------------------- I/O thread ---

void ShmTransport::io_loop() {
  name_this_thread(thread_prefix_ + "-shm-io");
  epoll_event events[64];
  std::vector<std::shared_ptr<Connection>> closed;
  auto next_check = Clock::time_point{};
  while (!io_stop_.load(std::memory_order_relaxed)) {
    int timeout_ms = -1;
    if (handshaking_ > 0) timeout_ms = ms_left(next_check);
    // Just served a request: the peer's next small one likely follows as
    // soon as it has the answer, so poll rather than sleep for a while.
    const bool busy = opt_.busy_poll.count() > 0 &&
                      Clock::now().time_since_epoch().count() -
                              last_request_ticks_.load(std::memory_order_relaxed) <
                          std::chrono::duration_cast<Clock::duration>(opt_.busy_poll).count();
    if (busy) timeout_ms = 0;
    // Request rings: served while polling, answers read that nobody else
    // reads; a bound on the sleep while ring requests are unanswered.
    if (const int ring_limit = ring_io_turn(busy); ring_limit >= 0) {
      timeout_ms = timeout_ms < 0 ? ring_limit : std::min(timeout_ms, ring_limit);
    }
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
      {
        // A waiter may be reading it (progress()): its frames are handled
        // in order by one reader at a time.
        std::lock_guard rx(c->rx_mu);
        if (!c->dead.load()) on_readable(*c);
      }
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
  io_ring_conns_.clear();
}

void ShmTransport::progress(const Transfer& transfer) {
  if (!opt_.caller_polls || transfer.finished()) return;
  std::shared_ptr<Connection> c;
  {
    std::lock_guard lock(mu_);
    auto it = primary_.find(transfer.peer());
    if (it == primary_.end()) return;
    c = it->second;
  }
  if (c->rings) {
    // While we poll the target answers into the ring without waking anyone
    // (shm_request_ring.h); answers there are read without a system call.
    c->ring_out.initiator_lease_ns().store(
        static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
                .count() +
            1000000),
        std::memory_order_relaxed);
    ring_harvest(*c);
    if (transfer.finished()) return;
    ring_serve(*c, /*wait=*/false);  // the peer's requests, as the socket's reader serves them
    // Only requests on the socket are answered on it.
    if (c->socket_unanswered.load(std::memory_order_relaxed) == 0) return;
  }
  // Never waits for the I/O thread: it is reading this socket, and will
  // hand the answer over itself.
  std::unique_lock rx(c->rx_mu, std::try_to_lock);
  if (!rx.owns_lock() || c->dead.load() || c->state != Connection::State::kOpen) return;
  // The same reading as the I/O thread's: every frame in order, the peer's
  // requests served too. A closed socket fails the connection here; the I/O
  // thread then sees it dead and drops it.
  on_readable(*c);
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

void ShmTransport::on_readable(Connection& c) {
  if (c.rx.empty()) c.rx.resize(kRxInitialBytes);
  // A bounded number of reads per wake-up keeps one busy peer from starving
  // the others.
  for (int round = 0; round < 16; ++round) {
    if (c.rx_len == c.rx.size()) c.rx.resize(c.rx.size() * 2);
    const size_t space = c.rx.size() - c.rx_len;
    // recvmsg: a HELLO_DONE brings the peer's staging area (SCM_RIGHTS).
    const ssize_t n = recv_with_fds(c.fd, c.rx.data() + c.rx_len, space, &c.rx_fds);
    if (n == -2 || c.rx_fds.size() > max_fds(c)) {
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
    if (s.ok() && c.state == Connection::State::kOpen && c.rx_fds.size() > max_fds(c)) {
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
  // Requests posted in the peer's ring before this frame was sent come
  // first (it sent this one on the socket only after them).
  if (c.rings && (is_request(h.op) || h.op == Op::kCancel)) ring_serve(c, /*wait=*/true);
  if (h.op == Op::kRingWake) {
    ring_harvest(c);
    ring_serve(c, /*wait=*/true);
    return Status::Ok();
  }
  if (h.op == Op::kRing) return on_ring(c, body);
  if (is_request(h.op)) {
    auto request = decode_request(h, body);
    if (!request.ok()) return request.status();
    // Staged requests need the areas (staging mode, or GPU areas beside
    // cross-memory attach); unstaged ones cross-memory attach.
    if (request->op != Op::kNotifyReq && (request->staged ? !c.stages_gpu() : c.staged)) {
      return err::ProtocolError(fmt::format(
          "{} {} {} staging area offsets on a connection in {} mode", op_name(request->op),
          request->id, request->staged ? "names" : "does not name",
          c.staged ? "staging" : "cross-memory attach"));
    }
    // Small requests are served here: a hand-off to a copy worker costs a
    // thread wake-up, more than copying a few pages. Large ones go to the
    // workers, which copy in parallel.
    const uint64_t bytes = request->total_bytes();
    if (bytes <= kBusyPollMaxBytes) {
      // Small: its initiator likely waits on the answer and sends the next
      // one soon after. (Larger requests keep no thread polling: their
      // copies need the cores.)
      last_request_ticks_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    }
    if (bytes <= opt_.inline_bytes) {
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

}  // namespace ferry::shm
