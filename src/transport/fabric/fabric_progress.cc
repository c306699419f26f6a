#include <dlfcn.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>

#include "core/block_cache.h"
#include "core/byte_codec.h"
#include "core/cpu_relax.h"
#include "core/thread_name.h"
#include "core/version.h"
#include "ferry/gpu.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/fabric/fabric_internal.h"
#include "transport/fabric/fabric_transport.h"

namespace ferry::fabric {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

// --- progress -------------------------------------------------------------------

void FabricTransport::wake(bool urgent) {
  if (wake_fd_ < 0) return;
  work_gen_.fetch_add(1);
  if (urgent) urgent_gen_.fetch_add(1);
  // Out of a waiter's way, the progress thread needs waking only for what
  // the waiter leaves to it; new ops are moved by the waiter's polling.
  const Sleep state = sleeping_.load();
  if (state == Sleep::kAwake || (state == Sleep::kWaiterPolls && !urgent)) return;
  uint64_t one = 1;
  [[maybe_unused]] auto w = ::write(wake_fd_, &one, sizeof one);
}

void FabricTransport::on_completion(Op* op, const Status& error) {
  // post_mu_ held.
  if (op->kind == Op::kRma) {
    --inflight_;
    inflight_bytes_ -= op->bytes;
    const RegionId region = op->remote_region;
    if (op->parts > 1) {
      std::shared_ptr<Job> jobs[Op::kMaxIov];
      uint64_t lengths[Op::kMaxIov];
      const size_t n = op->parts;
      for (size_t k = 0; k < n; ++k) {
        jobs[k] = k == 0 ? std::move(op->job) : std::move(op->more[k - 1]);
        lengths[k] = op->iov[k].iov_len;
      }
      const uint64_t op_bytes = op->bytes;
      give_op(op);
      if (jobs[0]) note_completed(*jobs[0]->peer, op_bytes);
      for (size_t k = 0; k < n; ++k) {
        if (jobs[k]) rma_done_locked(std::move(jobs[k]), region, -1, lengths[k], error);
      }
      return;
    }
    std::shared_ptr<Job> job = std::move(op->job);
    const int32_t group = op->group;
    const uint64_t bytes = op->bytes;
    give_op(op);
    if (!job) return;
    note_completed(*job->peer, bytes);
    rma_done_locked(std::move(job), region, group, bytes, error);
    return;
  }
  if (op->kind == Op::kSend) {
    std::shared_ptr<Job> job = std::move(op->job);
    give_op(op);
    // A job failed meanwhile (its peer declared dead) is finished already:
    // finishing it twice would take another job's place in live_jobs_.
    if (!job || job->finished) return;
    if (!error.ok()) {
      fail_job_locked(job, error);
      return;
    }
    job->finished = true;
    job->transfer->complete(Status::Ok());
    remove_live_locked(*job);
    notify_job_waiters_locked();
  }
}

void FabricTransport::rma_done_locked(std::shared_ptr<Job> job, RegionId region, int32_t group,
                                      uint64_t bytes, const Status& error) {
  ++job->done;
  if (group >= 0) {
    StageGroup& g = job->groups[static_cast<size_t>(group)];
    g.left -= std::min(g.left, bytes);
    // Only once none of its ops is in flight may the slot go back (a
    // stopped job's unposted pieces keep it until the job is dropped).
    if (g.left == 0) group_done_locked(job, static_cast<size_t>(group), error);
  }
  if (!error.ok()) {
    job->stopped = true;
    if (job->error.ok()) {
      bool revoked = false;
      {
        std::lock_guard plock(job->peer->mu);
        revoked = job->peer->revoked.count(region) > 0;
      }
      job->error = revoked
                       ? err::NotFound(fmt::format(
                             "fabric: region {} on {} was deregistered during the {}: {}", region,
                             describe(*job->peer), job->write ? "write" : "read", error.message()))
                       : error;
    }
  }
  maybe_finish_locked(job);
  notify_job_waiters_locked();
  if (!acks_due_.empty()) send_due_acks_locked();
}

void FabricTransport::handle_entry(const struct fi_cq_data_entry& e) {
  Op* op = static_cast<Op*>(e.op_context);
  if (!op) return;
  if (op->kind == Op::kRecv) {
    on_message(op->buf.data(), e.len);
    std::lock_guard lock(post_mu_);
    if (ep_ && !stop_.load()) {
      if (Status s = post_recv(op); !s.ok()) spdlog::error("ferry: {}", s.message());
    }
    return;
  }
  std::lock_guard lock(post_mu_);
  on_completion(op, Status::Ok());
}

size_t FabricTransport::read_cq_error_locked() {
  struct fi_cq_err_entry e {};
  char buf[256] = {};
  if (fi_cq_readerr(cq_, &e, 0) < 0) return 0;
  Op* op = static_cast<Op*>(e.op_context);
  const char* text = fi_cq_strerror(cq_, e.prov_errno, e.err_data, buf, sizeof buf);
  if (!op) return 1;
  if (op->kind == Op::kRecv) {
    if (e.err == FI_ECANCELED && stop_.load()) return 1;
    spdlog::warn("ferry: fabric: a receive failed: {} ({})", text ? text : "?", fi_error(e.err));
    std::lock_guard lock(post_mu_);
    if (ep_ && !stop_.load()) (void)post_recv(op);
    return 1;
  }
  // The connection to the peer is gone: every other transfer to it fails
  // now too and the engine hears of it, rather than at the keepalive deadline.
  std::shared_ptr<Peer> lost;
  Status st = [&] {
    std::lock_guard lock(post_mu_);
    const std::string who = op->job    ? describe(*op->job->peer)
                            : op->peer ? describe(*op->peer)
                                       : std::string("a peer");
    const std::string what = op->kind == Op::kRma
                                 ? fmt::format("{} of {} bytes on region {}",
                                               op->job && op->job->write ? "write" : "read",
                                               op->bytes, op->remote_region)
                                 : "message";
    std::string msg = fmt::format("fabric: {} to {} failed: {} (provider: {})", what, who,
                                  fi_error(e.err), text ? text : "?");
    Status why;
    if (op->kind == Op::kRma && e.err != FI_ECANCELED &&
        (e.prov_errno == ENOENT || e.err == FI_EKEYREJECTED || e.err == FI_EACCES)) {
      // The target's provider no longer knows the key: the region was
      // deregistered while the op was on its way (its REVOKE may still be
      // behind this completion). Not a cancel: tcp;ofi_rxm cancels the ops of
      // a connection whose peer died with ENOENT too, and that is a
      // disconnect, not a refusal.
      why = err::NotFound(
          fmt::format("fabric: region {} on {} refused the {} (deregistered while in flight?): {} "
                      "(provider: {})",
                      op->remote_region, who, op->job && op->job->write ? "write" : "read",
                      fi_error(e.err), text ? text : "?"));
    } else if (is_disconnect(e.err)) {
      why = err::PeerDisconnected(std::move(msg));
      lost = op->job ? op->job->peer : op->peer;
    } else {
      why = err::Internal(std::move(msg));
    }
    on_completion(op, why);
    return why;
  }();
  if (lost) fail_peer(lost, st);
  return 1;
}

size_t FabricTransport::drain_cq_locked(bool read_cq) {
  size_t handled = 0;
  while (!deferred_.empty()) {
    const struct fi_cq_data_entry e = deferred_.front();
    deferred_.pop_front();
    handle_entry(e);
    ++handled;
  }
  if (!read_cq) return handled;
  struct fi_cq_data_entry entries[kCqBatch];
  ssize_t n = fi_cq_read(cq_, entries, kCqBatch);
  if (n > 0) {
    // Completions in a row are handled under one post_mu_ (a message takes
    // it on its own, after on_message).
    for (ssize_t i = 0; i < n;) {
      const Op* first = static_cast<const Op*>(entries[i].op_context);
      if (first && first->kind == Op::kRecv) {
        handle_entry(entries[i++]);
        continue;
      }
      std::lock_guard lock(post_mu_);
      for (; i < n; ++i) {
        Op* op = static_cast<Op*>(entries[i].op_context);
        if (op && op->kind == Op::kRecv) break;
        if (op) on_completion(op, Status::Ok());
      }
    }
    return handled + static_cast<size_t>(n);
  }
  if (n == -FI_EAVAIL) return handled + read_cq_error_locked();
  if (n != -FI_EAGAIN) {
    spdlog::error("ferry: fabric: fi_cq_read: {}", fi_error(static_cast<int>(n)));
  }
  return handled;
}

void FabricTransport::progress(const Transfer& /*transfer*/) {
  // A waiter reads the CQ only when nobody else does and nothing read
  // earlier is still put aside (entries are handled in the order read).
  waiter_polled_ns_.store(now_ns(), std::memory_order_relaxed);
  std::unique_lock cq(cq_mu_, std::try_to_lock);
  if (!cq.owns_lock() || !deferred_.empty() || stop_.load() || !cq_) return;
  struct fi_cq_data_entry entries[kCqBatch];
  ssize_t n = fi_cq_read(cq_, entries, kCqBatch);
  if (n == -FI_EAVAIL) {
    // Errors are the progress thread's: one may declare a peer dead, which
    // calls into the engine.
    error_pending_.store(true);
    wake(/*urgent=*/true);
    return;
  }
  if (n <= 0) return;
  bool put_aside = false;
  {
    std::lock_guard lock(post_mu_);
    for (ssize_t i = 0; i < n; ++i) {
      Op* op = static_cast<Op*>(entries[i].op_context);
      // A message is handled by the progress thread (it may call into the
      // engine); so is every entry after it, to keep the order.
      if (put_aside || (op && op->kind == Op::kRecv)) {
        put_aside = true;
        deferred_.push_back(entries[i]);
        deferred_pending_.store(true);
        continue;
      }
      if (op) on_completion(op, Status::Ok());
    }
    pump_locked();
  }
  if (put_aside) wake(/*urgent=*/true);
}

void FabricTransport::drain_before_close() {
  // Closing tcp;ofi_rxm's endpoint with hundreds of MiB of RMA still posted
  // once crashed inside libfabric: give what is posted a moment to complete
  // (or fail) first. Only completions are counted; messages that arrive are
  // dropped (the engine is going away). Bounded: a dead peer's ops never end.
  if (!cq_) return;
  const auto until = Clock::now() + std::chrono::milliseconds(500);
  struct fi_cq_data_entry entries[kCqBatch];
  while (Clock::now() < until) {
    {
      std::lock_guard lock(post_mu_);
      if (inflight_ == 0) return;
    }
    ssize_t n = fi_cq_read(cq_, entries, kCqBatch);
    if (n == -FI_EAVAIL) {
      struct fi_cq_err_entry e {};
      if (fi_cq_readerr(cq_, &e, 0) <= 0) continue;
      entries[0].op_context = e.op_context;
      n = 1;
    }
    if (n <= 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      continue;
    }
    std::lock_guard lock(post_mu_);
    for (ssize_t i = 0; i < n; ++i) {
      Op* op = static_cast<Op*>(entries[i].op_context);
      if (op && op->kind != Op::kRecv) {
        on_completion(op, err::Cancelled("fabric: transport shut down"));
      }
    }
  }
}

void FabricTransport::stop_polling(const Transfer& /*transfer*/, bool finished) {
  if (finished) {
    // A waiter that found its transfer done (often without polling at all:
    // the progress thread had read the completion) renews the lease too: it
    // comes back with the next transfer and polls then. Without this, a
    // progress thread that once took the CQ over (a wait outlasted
    // engine.wait_spin_us) kept it while the waiter kept finding its
    // transfers done -- two busy initiator threads and the target's on 2
    // cores, and 4 KiB writes at 0.3 instead of 0.45 GB/s.
    waiter_polled_ns_.store(now_ns(), std::memory_order_relaxed);
    return;
  }
  // The waiter goes to sleep: the progress thread takes the CQ back now.
  waiter_polled_ns_.store(0, std::memory_order_relaxed);
  wake(/*urgent=*/true);
}

void FabricTransport::progress_loop() {
  name_this_thread("ferry-fabric");
  auto last_event = Clock::now();
  Clock::duration spin = opt_.poll_spin;  // adapts: see the end of the loop
  uint64_t pumped_gen = 0;
  int64_t waiter_nap_ns = kWaiterLeaseNs;  // see the waiter-polls sleep below
  while (!stop_.load()) {
    const uint64_t gen = work_gen_.load();
    const uint64_t urgent_gen = urgent_gen_.load();
    // A thread in wait() polled the CQ just now: it gets the completions
    // without a hand-over; two threads reading one CQ only take turns.
    const int64_t lease_left =
        waiter_polled_ns_.load(std::memory_order_relaxed) + kWaiterLeaseNs - now_ns();
    const bool waiter_polls = lease_left > 0 && !error_pending_.exchange(false);
    size_t handled = 0;
    // While a waiter polls, cq_mu_ is the waiter's: taking it only to find
    // nothing put aside cost a futex wait and wake-up per nap, each
    // preempting the waiter or the target's thread on 2 cores.
    if (!waiter_polls || deferred_pending_.load()) {
      std::lock_guard cq(cq_mu_);
      deferred_pending_.store(false);
      handled = drain_cq_locked(!waiter_polls);
    }
    if (handled > 0 || (!waiter_polls && (work_gen_.load() != pumped_gen ||
                                          backlog_.load(std::memory_order_relaxed)))) {
      // Room freed, work posted, or the provider said EAGAIN before (progress
      // may have made room, e.g. a connection came up): post what waits. A
      // waiter that polls the CQ pumps on its own: post_mu_ is left to it.
      pumped_gen = work_gen_.load();
      std::lock_guard lock(post_mu_);
      pump_locked();
    }
    timers();  // also while events keep coming: a dead peer is declared in time
    const auto now = Clock::now();
    if (handled > 0) {
      last_event = now;
      continue;
    }
    if (waiter_polls) {
      // Out of the waiter's way until its lease runs out (it stopped
      // polling) or a wake() comes. The nap is the lease left at first and
      // doubles (up to kMaxWaiterNapNs) each time the waiter renewed it
      // meanwhile.
      sleeping_.store(Sleep::kWaiterPolls);
      bool woken = false;
      if (urgent_gen_.load() == urgent_gen) {
        const int64_t nap = std::max(lease_left, waiter_nap_ns);
        struct pollfd fd = {wake_fd_, POLLIN, 0};
        const struct timespec ts = {nap / 1000000000, nap % 1000000000};
        woken = ::ppoll(&fd, 1, &ts, nullptr) > 0;
        if (fd.revents & POLLIN) {
          uint64_t v;
          [[maybe_unused]] auto r = ::read(wake_fd_, &v, sizeof v);
        }
      } else {
        woken = true;
      }
      sleeping_.store(Sleep::kAwake);
      const bool renewed =
          waiter_polled_ns_.load(std::memory_order_relaxed) + kWaiterLeaseNs > now_ns();
      waiter_nap_ns =
          !woken && renewed ? std::min(waiter_nap_ns * 2, kMaxWaiterNapNs) : kWaiterLeaseNs;
      last_event = Clock::time_point{};  // no spin after: read the CQ, then sleep on it
      continue;
    }
    // With manual progress (tcp;ofi_rxm) bytes move only while somebody reads
    // the CQ, on the target too: right after an event more usually follow,
    // so poll a little longer before paying for a sleep and a wake-up.
    if (now - last_event < spin) {
      for (int i = 0; i < 32; ++i) cpu_relax();
      continue;
    }
    // Nothing completed: sleep on the CQ's wait fd (and our wake-up fd) when
    // the provider agrees nothing is pending, else poll again.
    sleeping_.store(Sleep::kOnCq);
    if (work_gen_.load() != gen) {  // a wake() came after this round began
      sleeping_.store(Sleep::kAwake);
      continue;
    }
    const auto until_ping =
        std::chrono::duration_cast<std::chrono::milliseconds>(next_ping_ - Clock::now());
    const int timeout = static_cast<int>(std::clamp<int64_t>(until_ping.count(), 1, 100));
    struct pollfd fds[2];
    int nfds = 0;
    fds[nfds++] = {wake_fd_, POLLIN, 0};
    if (cq_fd_ >= 0) {
      struct fid* f = &cq_->fid;
      if (fi_trywait(fabric_, &f, 1) != 0) {
        // Events pending: read again, and poll a full spin more. A target's
        // provider moves incoming RMA without a completion to show for it, so
        // this (and a quick CQ wake-up, below) is all that shows a stream is
        // on: going to sleep in the middle of one costs a wake-up (on a VM an
        // interrupt to a halted vCPU) while the writer's bytes wait.
        sleeping_.store(Sleep::kAwake);
        last_event = Clock::now();
        continue;
      }
      fds[nfds++] = {cq_fd_, POLLIN, 0};
    }
    const auto slept = Clock::now();
    ::poll(fds, nfds, cq_fd_ >= 0 ? timeout : 1);
    sleeping_.store(Sleep::kAwake);
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] auto r = ::read(wake_fd_, &v, sizeof v);
    }
    last_event = Clock::now();
    // A target's provider moves incoming RMA without a completion to show for
    // it, so activity shows only as wake-ups: woken by the CQ after a sleep
    // shorter than the spin before it means a stream is on, with gaps the
    // spin would have covered -- poll longer next time (up to kMaxPollSpin),
    // as a raw busy loop would; a longer sleep resets it. (The bar was
    // fabric.poll_spin_us: one gap of 50 us-1 ms in a stream -- the writer
    // preempted, its wait gone to sleep -- dropped the spin back to 50 us,
    // and the target then slept between most writes: 2,800 sleeps a second,
    // each woken by the writer's softirq, in the slow 4 KiB rounds.)
    const bool cq_woke = nfds > 1 && (fds[1].revents & POLLIN);
    spin = cq_woke && last_event - slept < spin ? std::min<Clock::duration>(spin * 2, kMaxPollSpin)
                                                : Clock::duration(opt_.poll_spin);
  }
}

}  // namespace ferry::fabric
