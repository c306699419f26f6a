// NotificationQueue (see notification_queue.h).
#include "core/notification_queue.h"

#include <fmt/format.h>

#include <iterator>
#include <utility>

namespace ferry {

NotificationQueue::NotificationQueue(uint64_t max_bytes) : max_bytes_(max_bytes) {}

void NotificationQueue::set_max_bytes(uint64_t max_bytes) {
  std::lock_guard lock(mu_);
  max_bytes_ = max_bytes;
}

bool NotificationQueue::push(PeerId peer, Bytes payload) {
  const uint64_t cost = payload.size() + kEntryOverhead;
  {
    std::unique_lock lock(mu_);
    if (bytes_ + cost > max_bytes_) {
      const uint64_t queued = queue_.size(), bytes = bytes_, bound = max_bytes_,
                     dropped = ++dropped_;
      lock.unlock();
      drop_log_.log(
          spdlog::level::warn,
          fmt::format("ferry engine: dropped a {} B notification from peer {:016x}: {} "
                      "notifications ({} B with {} B counted per entry) wait to be "
                      "taken, the bound is {} B (engine.notification_queue_bytes); {} "
                      "dropped so far. Take them (take_notifications / "
                      "wait_notifications) or raise the bound",
                      payload.size(), peer, queued, bytes, kEntryOverhead, bound, dropped));
      return false;
    }
    bytes_ += cost;
    queue_.push_back({peer, std::move(payload)});
  }
  cv_.notify_all();
  return true;
}

std::vector<Notification> NotificationQueue::take() {
  std::lock_guard lock(mu_);
  std::vector<Notification> out(std::make_move_iterator(queue_.begin()),
                                std::make_move_iterator(queue_.end()));
  queue_.clear();
  bytes_ = 0;
  return out;
}

std::vector<Notification> NotificationQueue::wait(std::chrono::milliseconds timeout) {
  {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return !queue_.empty(); });
  }
  return take();
}

uint64_t NotificationQueue::queued_bytes() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

uint64_t NotificationQueue::dropped() const {
  std::lock_guard lock(mu_);
  return dropped_;
}

}  // namespace ferry
