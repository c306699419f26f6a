// cuda_ipc transport: the I/O thread (epoll loop, accept, reading and
// dispatching frames) and the completion thread (polling the copy streams,
// completing transfers and served requests).
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "core/cpu_relax.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/common/unix_socket.h"
#include "transport/cuda_ipc/cuda_ipc_internal.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"

namespace ferry::cuda_ipc {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

constexpr size_t kRxChunk = 64 << 10;
constexpr size_t kMaxQueuedFds = kMaxPieces + kMaxFdsPerFrame;

// A short pause in a polling loop (about a microsecond), easing the CPU and
// the driver lock while another thread polls.
void cpu_relax_for_a_moment() {
  for (int i = 0; i < 32; ++i) cpu_relax();
}

}  // namespace

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

}  // namespace ferry::cuda_ipc
