// shm transport, target side: the copy workers that check and serve the
// requests of peers, and the peer's cancel of requests still queued.
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
#include "transport/shm/shm_gpu_copy.h"
#include "transport/shm/shm_internal.h"
#include "transport/shm/shm_transport.h"

namespace ferry::shm {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

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
      copy_out(*task.answered.transfer, *task.conn, task.answered);
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
                              std::vector<RegionPin>* pins, std::vector<CopyPiece>* pieces,
                              std::vector<int>* devices) const {
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
    // GPU memory only through the staging areas: the target copies between
    // the peer's area and its GPU region with the copy engine.
    const bool gpu_region = region->info.kind == MemoryKind::kCuda;
    if (region->info.kind != MemoryKind::kHost && !(gpu_region && request.staged)) {
      return err::NotSupported(fmt::format(
          "shm: region {} is {} memory; shm carries it only through staging areas (this {} {} "
          "is not staged)",
          seg.remote.region_id, memory_kind_name(region->info.kind), op_name(request.op),
          request.id));
    }
    const int device = gpu_region ? region->info.device : -1;
    // Blocks adjacent on both sides (pages of one KV run, say) become one
    // iovec: the kernel pins and copies a run in one pass instead of per block.
    CopyPiece* last = pieces->empty() ? nullptr : &pieces->back();
    if (last && last->local + last->length == *local &&
        last->remote + last->length == seg.address && devices->back() == device) {
      last->length += seg.remote.length;
    } else {
      pieces->push_back({*local, seg.address, seg.remote.length});
      devices->push_back(device);
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
// One poll of both: the control socket (the initiator shut it down or gave up
// on us) and the initiator's pidfd (it exited: its EOF follows, and its pid
// may be reused). A small request's time is mostly system calls.
bool initiator_gone(const Connection& c) {
  pollfd p[2] = {{c.fd, POLLRDHUP, 0}, {c.pidfd, POLLIN, 0}};
  const nfds_t n = c.pidfd >= 0 ? 2 : 1;
  if (::poll(p, n, 0) <= 0) return false;
  return (p[0].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0 || (n == 2 && p[1].revents != 0);
}
// A pull (the bytes of a WRITE, read out of the initiator's memory) within
// kSeenRecently of a look that found the initiator there skips its own look:
// back-to-back small writes then pay one system call each (the copy), not
// two. A pull never changes the initiator's memory, so a stale answer can
// only put bytes the initiator stopped caring about into the target's own
// region (that write was given up, its bytes are undefined anyway); and the
// initiator's pid cannot be reused within it (pids are handed out in
// cycles of /proc/sys/kernel/pid_max). A push (a READ's bytes, written into
// the initiator's memory) always looks first.
constexpr auto kSeenRecently = std::chrono::microseconds(100);
bool initiator_still_there(Connection& c, Direction direction) {
  for (;;) {
    const auto asked = std::chrono::steady_clock::now();
    if (c.dead.load()) return false;
    const int64_t ticks = asked.time_since_epoch().count();
    if (direction == Direction::kPull &&
        ticks - c.initiator_seen.load(std::memory_order_relaxed) <
            std::chrono::duration_cast<std::chrono::steady_clock::duration>(kSeenRecently)
                .count()) {
      return true;
    }
    if (initiator_gone(c)) return false;
    if (std::chrono::steady_clock::now() - asked < kFreshCheck) {
      c.initiator_seen.store(ticks, std::memory_order_relaxed);
      return true;
    }
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
          {"request_ring", opt_.request_ring ? 1u : 0u},  // shm.request_ring as resolved
          {"requests_copied", requests_copied_.load(std::memory_order_relaxed)},
          {"peak_parallel_copies", peak_parallel_copies_.load(std::memory_order_relaxed)},
          {"ring_posted", ring_posted_.load(std::memory_order_relaxed)},
          {"ring_requests", ring_requests_.load(std::memory_order_relaxed)},
          {"ring_wakes_sent", ring_wakes_sent_.load(std::memory_order_relaxed)}};
}

std::optional<Status> ShmTransport::execute(Connection& c, Request& request) {
  // The initiator is gone, or we gave up on it (cancel timeout, protocol
  // error), or it gave up on us: copy nothing more into or out of its memory.
  // A cross-memory attach copy asks that right before its system call
  // (initiator_still_there, with the pidfd): asking here too would only cost
  // a system call more.
  const bool cma_copy_follows = !request.staged && !request.segments.empty();
  if (c.dead.load() || (!cma_copy_follows && peer_hung_up(c.fd))) return std::nullopt;
  if (request.cancelled) {
    return err::Cancelled(
        fmt::format("shm: {} {} was cancelled by the initiator before it was served",
                    op_name(request.op), request.id));
  }
  std::vector<RegionPin> pins;
  std::vector<CopyPiece> pieces;
  std::vector<int> devices;  // per piece: its region's GPU, -1 host memory
  Status verdict = validate(c, request, &pins, &pieces, &devices);
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
    // Between the region and the peer's area, both mapped here: host memory
    // cannot fail half-way (the area is sealed against shrinking, every range
    // was checked against its size). A GPU region's copies run on the copy
    // engine and are waited for before the answer.
    if (Status s = copy_through_area(c, /*own=*/false, pieces, devices,
                                     /*to_area=*/request.op == Op::kReadReq);
        !s.ok()) {
      verdict = Status(s.code(),
                       fmt::format("shm: {} {}: {}", op_name(request.op), request.id, s.message()));
    }
  } else if (verdict.ok() && !pieces.empty()) {
    size_t failed = 0;
    uint64_t moved = 0;
    const Direction direction = request.op == Op::kWriteReq ? Direction::kPull : Direction::kPush;
    if (Status s = cma_copy(c.pid, direction, pieces, &failed, &moved,
                            [&c, direction] { return initiator_still_there(c, direction); });
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

}  // namespace ferry::shm
