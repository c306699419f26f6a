// shm transport: small requests through the request rings (shm.request_ring,
// shm_request_ring.h) -- posting and reading answers on the initiator,
// serving on the target, the wake-ups for a side that is not polling, and the
// I/O thread's share of the work.
#include <sys/socket.h>

#include <cstring>

#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/shm/shm_internal.h"
#include "transport/shm/shm_transport.h"

namespace ferry::shm {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

// How long after its last poll a waiter of the initiator counts as polling:
// the target writes answers silently until then. A waiter that leaves
// without saying so (test() loops) leaves answers to the I/O thread, which
// looks at least this often while ring requests are unanswered.
constexpr int64_t kLeaseNs = 1000000;
constexpr int kHarvestEveryMs = 1;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

const Bytes& wake_frame() {
  static const Bytes frame = encode_ring_wake();
  return frame;
}

}  // namespace

// --------------------------------------------------------------- set-up ---

Status ShmTransport::make_ring_out(Connection& c) {
  auto ring =
      RequestRing::create(fmt::format("ferry-shm-ring-{:016x}-to-{:016x}", ctx_.engine_id, c.peer));
  if (!ring.ok()) return ring.status();
  c.ring_out = std::move(ring.value());
  c.rings = true;
  return Status::Ok();
}

Status ShmTransport::on_ring(Connection& c, ByteView body) {
  auto bytes = decode_ring(body);
  if (!bytes.ok()) return bytes.status();
  if (!c.rings || c.ring_in_ready.load()) {
    return err::ProtocolError(fmt::format(
        "{} sent a RING frame {}", describe(c),
        c.rings ? "a second time" : "on a connection whose handshake chose no request rings"));
  }
  if (c.rx_fds.size() != 1) {
    return err::ProtocolError(
        fmt::format("{} sent a RING frame with {} descriptor(s), expected its ring", describe(c),
                    c.rx_fds.size()));
  }
  const int fd = c.rx_fds.front();
  c.rx_fds.clear();
  auto ring = RequestRing::adopt(fd, *bytes);
  if (!ring.ok()) {
    return Status(ring.status().code(),
                  fmt::format("{}: {}", describe(c), ring.status().message()));
  }
  {
    std::lock_guard lock(c.ring_in_mu);
    c.ring_in = std::move(ring.value());
  }
  c.ring_in_ready.store(true, std::memory_order_release);
  ring_serve(c, /*wait=*/true);  // requests posted while the frame travelled
  return Status::Ok();
}

// ------------------------------------------------------------ initiator ---

bool ShmTransport::ring_post_locked(Connection& c, uint64_t id, const Bytes& frame,
                                    Pending& entry) {
  if (entry.bytes > opt_.ring_max_bytes || frame.size() > kRingRequestBytes) return false;
  // A request on the socket still unanswered could be overtaken: the target
  // serves the ring before each socket request it reads, not after.
  if (c.socket_unanswered.load(std::memory_order_relaxed) != 0) return false;
  const uint32_t slot = ring_slot(c.ring_next);
  // Full (the slot's previous request is unanswered or not read yet): the
  // socket takes it, and the ring again once that one is answered.
  if (c.ring_ids[slot] != 0) return false;
  // Counted before it is posted: whoever reads its answer finds it counted.
  c.ring_ids[slot] = id;
  c.ring_busy[slot / 64].fetch_or(uint64_t{1} << (slot % 64), std::memory_order_relaxed);
  c.ring_unanswered.fetch_add(1, std::memory_order_relaxed);
  c.ring_out.post(slot, c.ring_next, frame);
  ++c.ring_next;
  ring_posted_.fetch_add(1, std::memory_order_relaxed);
  entry.ring_slot = slot;
  entry.on_socket = false;
  return true;
}

void ShmTransport::ring_wake_peer(Connection& c) {
  // seq_cst, after the post's seq_cst store: either the target sees the post
  // in its last look before it lowers the flag, or we see the flag down.
  if (c.ring_out.target_polling().load(std::memory_order_seq_cst) != 0) return;
  // A wake on its way serves this post too (the target clears the word before
  // it looks at the ring).
  if (c.ring_out.target_woken().exchange(1, std::memory_order_seq_cst) != 0) return;
  ring_wakes_sent_.fetch_add(1, std::memory_order_relaxed);
  if (Status s = send_frame(c, wake_frame()); !s.ok()) fail_connection(c, s);
}

void ShmTransport::ring_harvest(Connection& c) {
  // A wake that came after its answers were read must not keep the next
  // one from being sent: the word goes down first, then we look.
  if (c.ring_out.initiator_woken().load(std::memory_order_relaxed) != 0) {
    c.ring_out.initiator_woken().store(0, std::memory_order_seq_cst);
  }
  if (c.ring_unanswered.load(std::memory_order_seq_cst) == 0) return;
  for (uint32_t word = 0; word < kRingSlots / 64; ++word) {
    uint64_t busy = c.ring_busy[word].load(std::memory_order_acquire);
    while (busy != 0) {
      const uint32_t slot = word * 64 + static_cast<uint32_t>(__builtin_ctzll(busy));
      busy &= busy - 1;
      uint32_t answered = static_cast<uint32_t>(SlotState::kAnswered);
      // One reader per answer: whoever moves it to HARVESTING.
      if (!c.ring_out.state(slot).compare_exchange_strong(
              answered, static_cast<uint32_t>(SlotState::kHarvesting), std::memory_order_seq_cst)) {
        continue;
      }
      auto response = c.ring_out.take_answer(slot);
      Status s =
          response.ok() ? handle_response(c, *response, static_cast<int>(slot)) : response.status();
      if (!s.ok()) {
        if (!c.dead.load()) {
          spdlog::warn("ferry shm: closing {}: {}", describe(c), s.message());
          fail_connection(c, s);
        }
        return;
      }
    }
  }
}

void ShmTransport::stop_polling(const Transfer& transfer, bool finished) {
  // A waiter that returned with its transfer done likely comes back soon: its
  // lease runs out by itself (kLeaseNs).
  if (finished || !opt_.caller_polls) return;
  std::shared_ptr<Connection> c;
  {
    std::lock_guard lock(mu_);
    auto it = primary_.find(transfer.peer());
    if (it == primary_.end()) return;
    c = it->second;
  }
  if (!c->rings || c->dead.load()) return;
  // Going to sleep: from now on the target wakes us for answers. seq_cst,
  // before our last look: an answer written before the target read the
  // lease is seen here.
  c->ring_out.initiator_lease_ns().store(0, std::memory_order_seq_cst);
  ring_harvest(*c);
}

// --------------------------------------------------------------- target ---

uint32_t ShmTransport::ring_serve(Connection& c, bool wait) {
  if (!c.ring_in_ready.load(std::memory_order_acquire)) return 0;
  std::unique_lock lock(c.ring_in_mu, std::defer_lock);
  if (wait) {
    lock.lock();
  } else if (!lock.try_lock()) {
    return 0;  // another thread serves it, in order
  }
  if (c.ring_in.target_woken().load(std::memory_order_relaxed) != 0) {
    c.ring_in.target_woken().store(0, std::memory_order_seq_cst);
  }
  uint32_t served = 0;
  while (!c.dead.load()) {
    const uint64_t sequence = c.ring_in_next;
    auto taken = c.ring_in.take_request(sequence);
    Status bad = taken.status();
    if (bad.ok() && taken->has_value()) {
      const Request& r = **taken;
      // The socket's rule: staged requests need the areas, unstaged ones
      // cross-memory attach.
      if (r.op != Op::kNotifyReq && (r.staged ? !c.stages_gpu() : c.staged)) {
        bad = err::ProtocolError(fmt::format(
            "request ring slot {}: {} {} {} staging area offsets on a connection in {} mode",
            ring_slot(sequence), op_name(r.op), r.id, r.staged ? "names" : "does not name",
            c.staged ? "staging" : "cross-memory attach"));
      }
    }
    if (!bad.ok()) {
      const Status why = err::ProtocolError(fmt::format("{}: {}", describe(c), bad.message()));
      spdlog::warn("ferry shm: closing {}: {}", describe(c), why.message());
      fail_connection(c, why);
      break;
    }
    if (!taken->has_value()) break;
    Request& request = **taken;
    ++c.ring_in_next;
    if (request.total_bytes() <= kBusyPollMaxBytes) {
      last_request_ticks_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    }
    ring_requests_.fetch_add(1, std::memory_order_relaxed);
    // Exactly the checks and the copy of a socket request.
    const std::optional<Status> verdict = execute(c, request);
    if (!verdict) break;  // the initiator is gone or gave up on us: no answer
    c.ring_in.answer(ring_slot(sequence), encode_response(request.id, *verdict));
    ++served;
  }
  lock.unlock();
  if (served > 0 && !c.dead.load()) {
    // seq_cst, after the answers' seq_cst stores: a waiter that lowers its
    // lease looks at the ring after that (stop_polling).
    const auto lease =
        static_cast<int64_t>(c.ring_in.initiator_lease_ns().load(std::memory_order_seq_cst));
    if (lease < now_ns() &&
        c.ring_in.initiator_woken().exchange(1, std::memory_order_seq_cst) == 0) {
      ring_wakes_sent_.fetch_add(1, std::memory_order_relaxed);
      if (!try_send_now(c, wake_frame()))
        submit(Task{c.shared_from_this(), {}, nullptr, wake_frame()});
    }
  }
  return served;
}

// ----------------------------------------------------------- I/O thread ---

int ShmTransport::ring_io_turn(bool busy) {
  if (ring_conns_gen_.load(std::memory_order_acquire) != io_ring_conns_gen_) {
    std::lock_guard lock(io_mu_);
    io_ring_conns_ = ring_conns_;
    io_ring_conns_gen_ = ring_conns_gen_.load();
  }
  if (io_ring_conns_.empty()) return -1;
  if (busy) {
    for (auto& c : io_ring_conns_) {
      if (c->dead.load() || !c->ring_in_ready.load(std::memory_order_acquire)) continue;
      if (c->ring_in.target_polling().load(std::memory_order_relaxed) == 0) {
        c->ring_in.target_polling().store(1, std::memory_order_seq_cst);
      }
      ring_serve(*c, /*wait=*/false);
    }
    io_rings_flagged_ = true;
  } else if (io_rings_flagged_) {
    // Going to sleep: flags down first, then a last look (an initiator that
    // still saw the flag up sent no wake).
    io_rings_flagged_ = false;
    uint32_t served = 0;
    for (auto& c : io_ring_conns_) {
      if (c->dead.load() || !c->ring_in_ready.load(std::memory_order_acquire)) continue;
      c->ring_in.target_polling().store(0, std::memory_order_seq_cst);
      served += ring_serve(*c, /*wait=*/true);
    }
    if (served > 0) return 0;
  }
  int limit = -1;
  for (auto& c : io_ring_conns_) {
    if (c->dead.load() || c->ring_unanswered.load(std::memory_order_relaxed) == 0) continue;
    // Answers a waiter that left without a word (a test() loop) may not read.
    ring_harvest(*c);
    limit = kHarvestEveryMs;
  }
  return limit;
}

}  // namespace ferry::shm
