#include "core/block_cache.h"
#include "core/cpu_relax.h"
#include "core/peer_window.h"
#include "core/transfer.h"
#include "transport/transport.h"

namespace ferry {

bool Transfer::complete(Status status) {
  // Timeout means "the wait ran out; the transfer goes on" (Engine::wait,
  // test). A transfer that *ended* because the peer did not answer in time
  // (a key request, a send the peer never drained) ends PeerDisconnected,
  // so a waiter never mistakes its end for a wait that ran out.
  if (status.code() == StatusCode::kTimeout) {
    status = Status(StatusCode::kPeerDisconnected, status.message());
  }
  if (completing_.exchange(true, std::memory_order_acq_rel)) {
    // Another call won: return once its status is visible, as when both
    // took a lock.
    while (!finished_.load(std::memory_order_acquire)) cpu_relax();
    return false;
  }
  status_ = std::move(status);
  // Before finished_: a caller who saw this transfer finish and posts again
  // finds its room free.
  release_window();
  // Logged before waiters can see the transfer finished.
  if (trace) trace->finish(id_, peer_, static_cast<uint8_t>(op_), bytes, status_.code());
  // seq_cst with the load of sleepers_ (and the sleeper's increment before
  // its look at finished_): either a sleeper sees finished_, or we see it.
  finished_.store(true, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    // Taken so the wake-up cannot fall between a sleeper's look and its sleep.
    { std::lock_guard lock(mu_); }
    cv_.notify_all();
  }
  return true;
}

void Transfer::hold_window(PeerWindows* windows, uint64_t window_bytes, uint64_t window_iovs) {
  window_bytes_ = window_bytes;
  window_iovs_ = window_iovs;
  window_.store(windows, std::memory_order_release);
}

void Transfer::release_window() {
  if (PeerWindows* w = window_.exchange(nullptr, std::memory_order_acq_rel)) {
    w->release(peer_, window_bytes_, window_iovs_);
  }
}

Status Transfer::status() const {
  // status_ is written once, before finished_ (release): no lock needed.
  if (!finished()) return Status(StatusCode::kInProgress, "");
  return status_;
}

bool Transfer::wait_until(std::chrono::steady_clock::time_point deadline,
                          std::chrono::microseconds spin) const {
  // A short spin first: a small transfer often completes within a few tens of
  // microseconds, less than it costs to put this thread to sleep and wake it.
  if (spin.count() > 0) {
    const auto spin_end = std::min(deadline, std::chrono::steady_clock::now() + spin);
    const uint32_t spins = transport != nullptr ? transport->progress_spins() : 64;
    do {
      for (uint32_t i = 0; i < spins; ++i) {
        if (finished_.load(std::memory_order_acquire)) {
          if (transport != nullptr) transport->stop_polling(*this, true);
          return true;
        }
        cpu_relax();
      }
      if (transport != nullptr) transport->progress(*this);
    } while (std::chrono::steady_clock::now() < spin_end);
  }
  // Going to sleep, spun or not: the transport stops counting on this thread
  // to poll. An earlier wait that found its transfer done left its lease
  // running (stop_polling(.., true)); a target that saw it still running
  // would answer into shm's request ring without waking us.
  if (transport != nullptr) transport->stop_polling(*this, false);
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  std::unique_lock lock(mu_);
  const bool done =
      cv_.wait_until(lock, deadline, [&] { return finished_.load(std::memory_order_seq_cst); });
  sleepers_.fetch_sub(1, std::memory_order_relaxed);
  return done;
}

bool Transfer::wait_for(std::chrono::milliseconds timeout, std::chrono::microseconds spin) const {
  if (finished_.load(std::memory_order_acquire)) {
    if (spin.count() > 0 && transport != nullptr) transport->stop_polling(*this, true);
    return true;
  }
  return wait_until(std::chrono::steady_clock::now() + timeout, spin);
}

void Transfer::note_error(const Status& s) {
  std::lock_guard lock(mu_);
  if (first_error_.ok()) first_error_ = s;
}

Status Transfer::first_error() const {
  std::lock_guard lock(mu_);
  return first_error_;
}

void Transfer::tx_begin() {
  std::lock_guard lock(mu_);
  ++tx_active_;
}

void Transfer::tx_end() {
  bool idle;
  {
    std::lock_guard lock(mu_);
    idle = --tx_active_ == 0;
  }
  if (idle) cv_.notify_all();
}

void Transfer::wait_tx_idle() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return tx_active_ == 0; });
}

TransferTable::TransferTable() : slots_(kMinSlots) {}

size_t TransferTable::index_of(TransferId id) const {
  if (id == kEmpty) return slots_.size();
  const size_t mask = slots_.size() - 1;
  for (size_t i = id & mask;; i = (i + 1) & mask) {
    if (slots_[i].id == id) return i;
    if (slots_[i].id == kEmpty) return slots_.size();
  }
}

void TransferTable::place(Slot s) {
  // Robin Hood: an entry farther from its home slot takes the place of one
  // nearer to its own. Sequential ids simply land in their home slots.
  const size_t mask = slots_.size() - 1;
  size_t dist = 0;
  for (size_t i = s.id & mask;; i = (i + 1) & mask, ++dist) {
    if (slots_[i].id == kEmpty) {
      slots_[i] = std::move(s);
      return;
    }
    const size_t d = (i - (slots_[i].id & mask)) & mask;
    if (d < dist) {
      std::swap(s, slots_[i]);
      dist = d;
    }
  }
}

void TransferTable::erase_at(size_t i) {
  // Backward shift: the entries after the hole move back one slot, up to an
  // empty slot or one at its home (Robin Hood order makes that the end): for
  // the usual run of consecutive ids, nothing moves.
  const size_t mask = slots_.size() - 1;
  for (size_t j = (i + 1) & mask;
       slots_[j].id != kEmpty && ((j - (slots_[j].id & mask)) & mask) != 0; j = (j + 1) & mask) {
    slots_[i] = std::move(slots_[j]);
    i = j;
  }
  slots_[i].id = kEmpty;
  slots_[i].transfer.reset();
  --live_;
  // Shrinks after a burst of calls in flight has drained.
  if (slots_.size() > kMinSlots && live_ * 8 < slots_.size()) resize(slots_.size() / 2);
}

void TransferTable::resize(size_t slots) {
  std::vector<Slot> old(slots);
  old.swap(slots_);
  for (Slot& s : old) {
    if (s.id != kEmpty) place(std::move(s));
  }
}

std::shared_ptr<Transfer> TransferTable::create(TransferOp op, PeerId peer) {
  std::lock_guard lock(mu_);
  // From the per-thread block cache (block_cache.h): no malloc per call.
  auto t = std::allocate_shared<Transfer>(BlockCacheAllocator<Transfer>(), next_id_++, op, peer);
  if ((live_ + 1) * 2 > slots_.size()) resize(slots_.size() * 2);
  place(Slot{t->id(), t});
  ++live_;
  return t;
}

std::shared_ptr<Transfer> TransferTable::find(TransferId id) const {
  std::lock_guard lock(mu_);
  const size_t i = index_of(id);
  return i == slots_.size() ? nullptr : slots_[i].transfer;
}

std::shared_ptr<Transfer> TransferTable::find(TransferId id, bool* taken) {
  std::lock_guard lock(mu_);
  const size_t i = index_of(id);
  if (i == slots_.size()) return nullptr;
  *taken = slots_[i].transfer->finished();
  if (!*taken) return slots_[i].transfer;
  std::shared_ptr<Transfer> t = std::move(slots_[i].transfer);
  erase_at(i);
  return t;
}

void TransferTable::erase(TransferId id) {
  std::lock_guard lock(mu_);
  if (const size_t i = index_of(id); i != slots_.size()) erase_at(i);
}

size_t TransferTable::size() const {
  std::lock_guard lock(mu_);
  return live_;
}

void TransferTable::fail_all(const Status& status) {
  std::lock_guard lock(mu_);
  for (Slot& s : slots_) {
    if (s.transfer) s.transfer->complete(status);
  }
}

}  // namespace ferry
