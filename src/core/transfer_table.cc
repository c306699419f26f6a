#include "core/cpu_relax.h"
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
  {
    std::lock_guard lock(mu_);
    if (finished_.load(std::memory_order_relaxed)) return false;
    status_ = std::move(status);
    // Logged before waiters can see the transfer finished.
    if (trace) trace->finish(id_, peer_, static_cast<uint8_t>(op_), bytes, status_.code());
    finished_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  return true;
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
    if (transport != nullptr) transport->stop_polling(*this, false);
  }
  std::unique_lock lock(mu_);
  return cv_.wait_until(lock, deadline, [&] { return finished_.load(std::memory_order_relaxed); });
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

std::shared_ptr<Transfer> TransferTable::create(TransferOp op, PeerId peer) {
  std::lock_guard lock(mu_);
  auto t = std::make_shared<Transfer>(next_id_++, op, peer);
  live_.emplace(t->id(), t);
  return t;
}

std::shared_ptr<Transfer> TransferTable::find(TransferId id) const {
  std::lock_guard lock(mu_);
  auto it = live_.find(id);
  return it == live_.end() ? nullptr : it->second;
}

std::shared_ptr<Transfer> TransferTable::find(TransferId id, bool* taken) {
  std::lock_guard lock(mu_);
  auto it = live_.find(id);
  if (it == live_.end()) return nullptr;
  std::shared_ptr<Transfer> t = it->second;
  *taken = t->finished();
  if (*taken) live_.erase(it);
  return t;
}

void TransferTable::erase(TransferId id) {
  std::lock_guard lock(mu_);
  live_.erase(id);
}

size_t TransferTable::size() const {
  std::lock_guard lock(mu_);
  return live_.size();
}

void TransferTable::fail_all(const Status& status) {
  std::lock_guard lock(mu_);
  for (auto& [id, t] : live_) t->complete(status);
}

}  // namespace ferry
