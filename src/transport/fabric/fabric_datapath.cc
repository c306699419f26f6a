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

// --- posting --------------------------------------------------------------------

Op* FabricTransport::take_op() {
  if (free_ops_.empty()) {
    ops_.push_back(std::make_unique<Op>());
    return ops_.back().get();
  }
  Op* op = free_ops_.back();
  free_ops_.pop_back();
  return op;
}

void FabricTransport::give_op(Op* op) {
  op->job.reset();
  for (size_t k = 1; k < op->parts; ++k) op->more[k - 1].reset();
  op->parts = 1;
  op->group = -1;
  op->peer.reset();
  op->bytes = 0;
  op->niov = 0;
  if (!op->mr) op->buf.clear();
  free_ops_.push_back(op);
}

Status FabricTransport::send(const std::shared_ptr<Peer>& p, fi_addr_t addr, MsgType type,
                             uint64_t request, const Bytes& body) {
  Bytes bytes = encode(type, ctx_.engine_id, request, body);
  std::lock_guard lock(post_mu_);
  return send_locked(p, addr, std::move(bytes), nullptr);
}

Status FabricTransport::send_locked(const std::shared_ptr<Peer>& p, fi_addr_t addr, Bytes bytes,
                                    std::shared_ptr<Job> job) {
  if (!ep_ || stop_.load()) return err::Cancelled("fabric: transport shut down");
  Op* op = take_op();
  op->kind = Op::kSend;
  op->peer = p;
  op->job = std::move(job);
  if (op->mr) {
    fi_close(&op->mr->fid);
    op->mr = nullptr;
  }
  op->buf = std::move(bytes);
  if (mr_mode_ & FI_MR_LOCAL) {
    int r = fi_mr_reg(domain_, op->buf.data(), op->buf.size(), FI_SEND, 0, next_key_.fetch_add(1),
                      0, &op->mr, nullptr);
    if (r != 0) {
      give_op(op);
      return err::Internal("fabric: registering a send buffer: " + fi_error(r));
    }
  }
  op->to = addr;  // kept for a retry after FI_EAGAIN
  // Per peer in order: behind a message to the same peer still waiting for
  // room, never behind another peer's (a dead peer must not block the rest).
  if (std::any_of(send_queue_.begin(), send_queue_.end(),
                  [addr](const Op* q) { return q->to == addr; })) {
    send_queue_.push_back(op);
    wake(/*urgent=*/true);
    return Status::Ok();
  }
  struct iovec iov {
    op->buf.data(), op->buf.size()
  };
  void* desc = op->mr ? fi_mr_desc(op->mr) : nullptr;
  struct fi_msg msg {};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = addr;
  msg.context = &op->ctx;
  ssize_t r =
      fi_sendmsg(ep_, &msg, FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0));
  if (r == -FI_EAGAIN) {
    send_queue_.push_back(op);
    wake(/*urgent=*/true);
    return Status::Ok();
  }
  if (r != 0) {
    give_op(op);
    return err::PeerDisconnected(fmt::format("fabric: {}: fi_send: {}",
                                             p ? describe(*p) : std::string("peer"),
                                             fi_error(static_cast<int>(r))));
  }
  return Status::Ok();
}

Status FabricTransport::post(PeerId peer, const std::shared_ptr<Transfer>& t,
                             std::vector<Segment>& segments, bool write) {
  auto p = live_peer(peer);
  if (!p.ok()) return p.status();
  if (write && t->has_notification && t->notification.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes exceeds the limit of {}",
                                            t->notification.size(), kMaxNotificationBytes));
  }
  // Core routes the peer's GPU memory here only where the peer has FI_HMEM
  // (capabilities_for); local GPU memory is direct under FI_HMEM, else staged.
  bool staged = false, gpu_direct = false;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.remote_device >= 0 && !(*p)->hmem) {
      return err::NotSupported(fmt::format(
          "fabric: {} iov {}: region {} of {} is GPU memory, and the peer does not register GPU "
          "memory with FI_HMEM: it cannot be reached one-sided (tcp carries it)",
          write ? "write" : "read", i, s.remote.region_id, describe(**p)));
    }
    if (s.local_device >= 0) (hmem_ ? gpu_direct : staged) = true;
  }
  // From the per-thread block cache (core/block_cache.h): no malloc per call.
  auto job = std::allocate_shared<Job>(BlockCacheAllocator<Job>());
  job->transfer = t;
  job->peer = *p;
  job->write = write;
  job->segs = std::move(segments);
  if (staged) {
    auto path = gpu();
    if (!path.ok()) return path.status();
    if (Status s = plan_staging(*job, *path); !s.ok()) return s;
    if (!write) {
      // The landing copies come when the data is in: they run after what the
      // caller queued on the default stream before this call, and nothing later.
      std::vector<int> devices;
      for (const Segment& s : job->segs) {
        if (s.local_device >= 0) devices.push_back(s.local_device);
      }
      auto mark = DefaultStreamMark::take(devices);
      if (!mark.ok()) return mark.status();
      job->after = std::move(mark.value());
    }
  }
  JobSegments& segs = job->segs;
  if (segs.size() > 1) job->more_keys.resize(segs.size());
  if ((mr_mode_ & FI_MR_LOCAL) || gpu_direct) job->descs.resize(segs.size());
  bool handed_over = false;  // every op of the job is with the provider
  const uint64_t revoke_gen = (*p)->revoke_gen.load();
  // Keys: one request per descriptor the first time, then a cache hit; a run
  // of segments on one descriptor looks it up once.
  const RemoteAccessRequest* last = nullptr;
  RemoteKey last_key;
  for (size_t i = 0; i < segs.size(); ++i) {
    const RemoteAccessRequest& r = segs[i].remote;
    if (!last || key_of(*last) != key_of(r)) {
      auto k = grant_for(*p, r, revoke_gen);
      if (!k.ok()) {
        // Refusals are the transfer's result, as tcp reports them.
        t->complete(k.status());
        return Status::Ok();
      }
      last_key = *k;
      last = &r;
    }
    job->key(i) = {last_key.mr_key, last_key.base + r.adv_offset + r.offset};
    if (job->descs.empty()) continue;
    if (!job->group_of.empty() && job->group_of[i] >= 0) {
      job->descs[i] = staging_desc_;  // the pool's registration
    } else if ((mr_mode_ & FI_MR_LOCAL) || segs[i].local_device >= 0) {
      auto d = local_desc(segs[i]);
      if (!d.ok()) return d.status();
      job->descs[i] = *d;
    }
  }
  {
    std::lock_guard lock(post_mu_);
    if ((*p)->dead.load()) {
      std::lock_guard plock((*p)->mu);
      return err::PeerDisconnected(fmt::format("fabric: {}: {}", describe(**p), (*p)->dead_reason));
    }
    if ((*p)->revoke_gen != revoke_gen) {
      // A REVOKE came while the keys were looked up: none may be used.
      std::unordered_set<RegionId> gone;
      {
        std::lock_guard plock((*p)->mu);
        gone = (*p)->revoked;
      }
      for (const Segment& s : job->segs) {
        if (gone.count(s.remote.region_id)) {
          t->complete(revoked_error(**p, s.remote.region_id));
          return Status::Ok();
        }
      }
    }
    add_live_locked(job);
    if (queue_.empty() && send_queue_.empty() && job->groups.empty() && !held_for_combining(*job)) {
      // Nothing waits before it: posted here, without a round through queue_
      // (what the window or the provider leaves joins it).
      while (!job->stopped && job->next < segs.size() && inflight_ < opt_.max_inflight &&
             inflight_bytes_ < opt_.max_inflight_bytes && !peer_window_full(*job->peer) &&
             post_one_locked(*job, job)) {
      }
      if (!job->stopped && job->next < segs.size()) {
        queue_.push_back(job);
        backlog_.store(true, std::memory_order_relaxed);
      }
    } else {
      queue_.push_back(job);
      pump_locked();
    }
    maybe_finish_locked(job);
    // A job held for combining needs no wake-up either: the completion of
    // one of its peer's ops in flight pumps it.
    const bool held = held_for_combining(*job);
    counts_.held_calls += held;
    handed_over = job->finished || job->stopped ||
                  (job->next >= job->segs.size() && job->groups.empty() && send_queue_.empty()) ||
                  held;
  }
  if (!job->groups.empty()) start_staging(job);
  // Nobody will poll the CQ for a transfer this large (core's wait() sleeps
  // at once): a progress thread napping behind a waiter's lease takes the CQ
  // back now.
  // (The lease is cleared whatever the thread is doing: one about to
  // decide to nap would otherwise still see it.)
  const bool unpolled = t->bytes > kPolledMaxBytes;
  if (unpolled) waiter_polled_ns_.store(0, std::memory_order_relaxed);
  // A small transfer handed to the provider whole needs nothing from the
  // progress thread: a waiter polls for it, and a progress thread asleep on
  // the CQ's wait fd is woken by the provider when it completes. Waking it
  // anyway cost an eventfd write per call and, once the progress thread had
  // taken the CQ (a loaded machine, a wait past engine.wait_spin_us), a
  // context switch per call (0.7 eventfd writes per 4 KiB write measured).
  // Without a wait fd the thread naps 1 ms at a time: then it is woken.
  if (unpolled || !handed_over || cq_fd_ < 0) wake(unpolled);
  return Status::Ok();
}

Status FabricTransport::post_write(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                   std::vector<Segment> segments) {
  return post(peer, transfer, segments, true);
}

Status FabricTransport::post_read(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                  std::vector<Segment> segments) {
  return post(peer, transfer, segments, false);
}

Status FabricTransport::post_notification(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                          Bytes payload) {
  if (payload.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes exceeds the limit of {}",
                                            payload.size(), kMaxNotificationBytes));
  }
  transfer->notification = std::move(payload);
  transfer->has_notification = true;
  std::vector<Segment> none;
  return post(peer, transfer, none, true);
}

// Posts one operation of `job`: consecutive segments under one key, several
// local iovs, and as many remote ranges as the provider takes per operation
// (rma_iov_limit; a segment that continues the previous remote range extends
// it); false when the window or the provider is full.
bool FabricTransport::post_one_locked(Job& job, const std::shared_ptr<Job>& ref) {
  Op* op = take_op();
  op->kind = Op::kRma;
  size_t i = job.next;
  uint64_t off = job.next_off;
  uint64_t total = 0;
  const uint64_t key = job.key(i).mr_key;
  size_t nrma = 1;
  op->rma[0] = {job.key(i).base + off, 0, key};
  // Staged pieces: one op never mixes groups (a group's slot goes back when
  // its bytes completed) nor splits a piece (each fits one op).
  auto group_at = [&job](size_t k) { return job.group_of.empty() ? -1 : job.group_of[k]; };
  const int32_t group = group_at(i);
  op->group = group;
  op->niov = 0;
  size_t end_i = i;
  uint64_t end_off = off;
  while (end_i < job.segs.size() && op->niov < iov_limit_) {
    const Segment& s = job.segs[end_i];
    if (op->niov > 0) {
      if (job.key(end_i).mr_key != key || group_at(end_i) != group ||
          (group >= 0 && s.length > max_op_bytes_ - total)) {
        break;
      }
      const struct fi_rma_iov& last = op->rma[nrma - 1];
      if (job.key(end_i).base != last.addr + last.len) {
        if (nrma == rma_iov_limit_) break;
        op->rma[nrma++] = {job.key(end_i).base, 0, key};
      }
    }
    const uint64_t take = std::min<uint64_t>(s.length - end_off, max_op_bytes_ - total);
    op->rma[nrma - 1].len += take;
    op->iov[op->niov].iov_base = group >= 0 ? job.groups[static_cast<size_t>(group)].slot->data() +
                                                  job.slot_off[end_i] + end_off
                                            : s.local + end_off;
    op->iov[op->niov].iov_len = take;
    op->desc[op->niov] = job.descs.empty() ? nullptr : job.descs[end_i];
    ++op->niov;
    total += take;
    end_off += take;
    if (end_off == s.length) {
      ++end_i;
      end_off = 0;
    }
    if (total == max_op_bytes_) break;
  }
  op->bytes = total;
  op->remote_region = job.segs[i].remote.region_id;
  struct fi_msg_rma msg {};
  msg.msg_iov = op->iov;
  msg.desc = job.descs.empty() ? nullptr : op->desc;
  msg.iov_count = op->niov;
  msg.addr = job.peer->addr;
  msg.rma_iov = op->rma;
  msg.rma_iov_count = nrma;
  msg.context = &op->ctx;
  const ssize_t r = submit_rma(msg, job.write);
  if (r == -FI_EAGAIN) {
    give_op(op);
    return false;
  }
  if (r != 0) {
    give_op(op);
    job.stopped = true;
    if (job.error.ok()) {
      job.error = err::PeerDisconnected(
          fmt::format("fabric: {}: posting {} of {} bytes to region {}: {}", describe(*job.peer),
                      job.write ? "a write" : "a read", total, job.segs[i].remote.region_id,
                      fi_error(static_cast<int>(r))));
    }
    return false;
  }
  op->job = ref;
  job.next = end_i;
  job.next_off = end_off;
  ++job.posted;
  note_posted_locked(*job.peer, total);
  return true;
}

ssize_t FabricTransport::submit_rma(const struct fi_msg_rma& msg, bool write) {
  return write ? fi_writemsg(ep_, &msg,
                             FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0))
               : fi_readmsg(ep_, &msg, FI_COMPLETION);
}

void FabricTransport::note_posted_locked(Peer& p, uint64_t bytes) {
  ++inflight_;
  inflight_bytes_ += bytes;
  ++p.inflight_ops;
  p.inflight_bytes += bytes;
  ++counts_.rma_ops;
}

std::vector<std::pair<std::string, uint64_t>> FabricTransport::counters() const {
  std::lock_guard lock(post_mu_);
  return {{"rma_ops", counts_.rma_ops},
          {"combined_ops", counts_.combined_ops},
          {"combined_calls", counts_.combined_calls},
          {"held_calls", counts_.held_calls},
          {"av_entries", av_table_ ? av_table_->live() : 0},
          {"queued_sends", send_queue_.size()}};
}

bool FabricTransport::combinable(const Job& job) const {
  return combine_limit_ > 1 && job.segs.size() == 1 && job.next == 0 && job.next_off == 0 &&
         !job.stopped && job.groups.empty() && job.segs[0].local_device < 0 &&
         job.segs[0].length > 0 && job.segs[0].length <= opt_.combine_max_bytes;
}

bool FabricTransport::held_for_combining(const Job& job) const {
  return combinable(job) && job.peer->inflight_ops >= opt_.combine_after &&
         (job.hold_until == 0 || job.peer->completed_ops < job.hold_until);
}

bool FabricTransport::post_combined_locked(const std::shared_ptr<Job>* parts, size_t n) {
  Job& first = *parts[0];
  Op* op = take_op();
  op->kind = Op::kRma;
  op->group = -1;
  op->niov = n;
  uint64_t total = 0;
  for (size_t k = 0; k < n; ++k) {
    Job& j = *parts[k];
    const Segment& s = j.segs[0];
    op->iov[k].iov_base = s.local;
    op->iov[k].iov_len = s.length;
    op->desc[k] = j.descs.empty() ? nullptr : j.descs[0];
    op->rma[k].addr = j.key(0).base;
    op->rma[k].len = s.length;
    op->rma[k].key = j.key(0).mr_key;
    total += s.length;
  }
  op->bytes = total;
  op->remote_region = first.segs[0].remote.region_id;
  struct fi_msg_rma msg {};
  msg.msg_iov = op->iov;
  msg.desc = first.descs.empty() ? nullptr : op->desc;
  msg.iov_count = n;
  msg.addr = first.peer->addr;
  msg.rma_iov = op->rma;
  msg.rma_iov_count = n;
  msg.context = &op->ctx;
  const ssize_t r = submit_rma(msg, first.write);
  if (r == -FI_EAGAIN) {
    give_op(op);
    return false;
  }
  if (r != 0) {
    give_op(op);
    for (size_t k = 0; k < n; ++k) {
      Job& j = *parts[k];
      j.stopped = true;
      if (j.error.ok()) {
        j.error = err::PeerDisconnected(fmt::format(
            "fabric: {}: posting {} of {} bytes to region {} (combined with {} other small "
            "operations): {}",
            describe(*j.peer), j.write ? "a write" : "a read", j.segs[0].length,
            j.segs[0].remote.region_id, n - 1, fi_error(static_cast<int>(r))));
      }
    }
    return false;
  }
  op->job = parts[0];
  op->parts = n;
  for (size_t k = 0; k < n; ++k) {
    Job& j = *parts[k];
    if (k > 0) op->more[k - 1] = parts[k];
    j.next = 1;
    ++j.posted;
  }
  note_posted_locked(*first.peer, total);
  ++counts_.combined_ops;
  counts_.combined_calls += n;
  return true;
}

void FabricTransport::pump_locked() {
  if (!ep_) return;
  // Control messages first, in order per peer; a peer whose queue is full
  // (FI_EAGAIN) holds back only its own messages and operations.
  std::vector<fi_addr_t> blocked;
  auto is_blocked = [&blocked](fi_addr_t a) {
    return std::find(blocked.begin(), blocked.end(), a) != blocked.end();
  };
  for (auto it = send_queue_.begin(); it != send_queue_.end();) {
    Op* op = *it;
    if (is_blocked(op->to)) {
      ++it;
      continue;
    }
    struct iovec iov {
      op->buf.data(), op->buf.size()
    };
    void* desc = op->mr ? fi_mr_desc(op->mr) : nullptr;
    struct fi_msg msg {};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = op->to;
    msg.context = &op->ctx;
    ssize_t r =
        fi_sendmsg(ep_, &msg, FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0));
    if (r == -FI_EAGAIN) {
      blocked.push_back(op->to);
      ++it;
      continue;
    }
    it = send_queue_.erase(it);
    if (r != 0) {
      on_completion(op, err::PeerDisconnected("fabric: fi_send: " + fi_error(static_cast<int>(r))));
    }
  }
  // Jobs held for combining are not backlog: a completion pumps them.
  bool backlog = false;
  std::shared_ptr<Job> parts[Op::kMaxIov];
  for (auto it = queue_.begin(); it != queue_.end();) {
    std::shared_ptr<Job> job = *it;
    if (job->stopped || job->next >= job->segs.size()) {
      it = queue_.erase(it);
      maybe_finish_locked(job);
      continue;
    }
    if (inflight_ >= opt_.max_inflight || inflight_bytes_ >= opt_.max_inflight_bytes) {
      backlog = true;
      break;
    }
    if (is_blocked(job->peer->addr) || staged_waiting_locked(*job)) {
      backlog = true;
      ++it;  // a staged group still waits for its slot or copy: not the peer's fault
      continue;
    }
    if (peer_window_full(*job->peer)) {
      blocked.push_back(job->peer->addr);  // its completions pump it again
      backlog = true;
      ++it;
      continue;
    }
    if (combinable(*job)) {
      // Company from the jobs queued behind it: same peer, direction and
      // remote region (a refused key fails only what asked for it).
      size_t n = 1;
      parts[0] = job;
      uint64_t bytes = job->segs[0].length;
      size_t looked = 0;
      for (auto jt = std::next(it);
           jt != queue_.end() && n < combine_limit_ && looked < 4 * combine_limit_;
           ++jt, ++looked) {
        const Job& o = **jt;
        if (o.peer != job->peer || o.write != job->write || !combinable(o) ||
            o.segs[0].remote.region_id != job->segs[0].remote.region_id ||
            o.key(0).mr_key != job->key(0).mr_key || o.descs.empty() != job->descs.empty() ||
            bytes + o.segs[0].length > max_op_bytes_) {
          continue;
        }
        parts[n++] = *jt;
        bytes += o.segs[0].length;
      }
      const bool hold = n < combine_limit_ && held_for_combining(*job);
      if (hold && job->hold_until == 0) job->hold_until = job->peer->completed_ops + 1;
      bool posted = false;
      if (!hold && n > 1) posted = post_combined_locked(parts, n);
      for (size_t k = 0; k < n; ++k) parts[k].reset();
      if (hold) {
        ++it;
        continue;
      }
      if (n > 1) {
        if (!posted && !job->stopped) {
          blocked.push_back(job->peer->addr);  // FI_EAGAIN: retried after completions
          backlog = true;
          ++it;
        }
        continue;
      }
    }
    if (!post_one_locked(*job, job) && !job->stopped) {
      blocked.push_back(job->peer->addr);  // FI_EAGAIN: retried after completions
      backlog = true;
      ++it;
    }
  }
  backlog_.store(!send_queue_.empty() || backlog, std::memory_order_relaxed);
}

void FabricTransport::drop_queued_locked(const Job& job) {
  std::erase_if(queue_, [&job](const std::shared_ptr<Job>& q) { return q.get() == &job; });
}

void FabricTransport::add_live_locked(const std::shared_ptr<Job>& job) {
  job->live_index = live_jobs_.size();
  job->transfer->transport_state = job.get();
  live_jobs_.push_back(job);
}

void FabricTransport::remove_live_locked(Job& job) {
  // The last one takes its place.
  const size_t i = job.live_index;
  job.transfer->transport_state = nullptr;
  if (i + 1 != live_jobs_.size()) {
    live_jobs_[i] = std::move(live_jobs_.back());
    live_jobs_[i]->live_index = i;
  }
  live_jobs_.pop_back();
}

void FabricTransport::stop_staged_job_locked(Job& job, const Status& s, const std::string& what) {
  job.stopped = true;
  if (job.error.ok()) {
    job.error = Status(s.code(), fmt::format("fabric: {}: {}", what, s.message()));
  }
}

void FabricTransport::fail_job_locked(const std::shared_ptr<Job>& job, const Status& s) {
  job->stopped = true;
  if (job->error.ok()) job->error = s;
  if (!job->finished) {
    job->finished = true;
    job->transfer->complete(job->error);
    remove_live_locked(*job);
  }
  notify_job_waiters_locked();
}

void FabricTransport::notify_job_waiters_locked() {
  if (job_waiters_ > 0) job_cv_.notify_all();
}

void FabricTransport::maybe_finish_locked(const std::shared_ptr<Job>& job) {
  if (job->finished) return;
  const bool all_posted = job->stopped || job->next >= job->segs.size();
  if (!all_posted || job->done != job->posted || job->copies != 0) return;
  if (!job->error.ok()) {
    fail_job_locked(job, job->error);
    return;
  }
  Transfer& t = *job->transfer;
  if (job->write && t.has_notification && !job->notify_posted) {
    // Every RMA op of the write has completed (delivery-complete: placed at
    // the target), so the notification cannot overtake the data.
    job->notify_posted = true;
    Status s = send_locked(job->peer, job->peer->addr,
                           encode(MsgType::kNotify, ctx_.engine_id, t.id(), t.notification), job);
    if (!s.ok()) fail_job_locked(job, s);
    return;
  }
  if (job->write && t.has_notification) return;  // waits for the NOTIFY send
  job->finished = true;
  t.complete(Status::Ok());
  remove_live_locked(*job);
  notify_job_waiters_locked();
}

void FabricTransport::cancel(Transfer& transfer) {
  std::unique_lock lock(post_mu_);
  if (!transfer.transport_state) return;
  std::shared_ptr<Job> job = live_jobs_[static_cast<Job*>(transfer.transport_state)->live_index];
  job->stopped = true;
  if (job->error.ok()) {
    job->error = err::Cancelled(fmt::format("transfer {} was cancelled", transfer.id()));
  }
  // Its segments not yet handed to the provider never will be: out of the
  // queue now, not when the pump reaches it -- behind a window that a
  // stalled peer holds full, that is never, and every call cancelled there
  // would stay queued with its segment list.
  drop_queued_locked(*job);
  // Ops already handed to the provider cannot be called back: wait until the
  // provider gives them back. A dead peer does not end the wait -- a stopped
  // one resumes and its answers still land in the buffers -- only the bound.
  ++job_waiters_;
  const bool returned = job_cv_.wait_for(
      lock, opt_.cancel_timeout, [&] { return job->done == job->posted && job->copies == 0; });
  --job_waiters_;
  if (!returned) {
    spdlog::error(
        "ferry: fabric: cancel of transfer {} to {} gave up after {} ms "
        "(fabric.cancel_timeout_ms): the provider still holds {} of its operations and may "
        "still touch its buffers",
        transfer.id(), describe(*job->peer), opt_.cancel_timeout.count(), job->posted - job->done);
  }
  maybe_finish_locked(job);
}

}  // namespace ferry::fabric
