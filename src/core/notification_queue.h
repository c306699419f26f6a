// The notifications an engine has received and the application has not taken
// yet. Bounded: a peer may send notifications that nobody collects (an
// application that only moves data, or one that stopped polling), and that
// must not grow the engine's memory without limit. Past the bound a new
// notification is dropped, so what the application takes is always a prefix of
// what arrived, in order; drops are counted per engine (dropped()) and named
// in a rate-limited warning with the sender and the bound.
//
// Thread-safe: transports push from their threads, the application takes.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "core/log_limiter.h"
#include "ferry/types.h"

namespace ferry {

class NotificationQueue {
 public:
  // What one queued notification is counted as besides its payload: the
  // queue's entry and the payload's allocation.
  static constexpr uint64_t kEntryOverhead = 64;

  explicit NotificationQueue(uint64_t max_bytes = 256ull << 20);

  // Sets the bound (the engine's option engine.notification_queue_bytes).
  void set_max_bytes(uint64_t max_bytes);
  // Queues the notification and wakes waiters; false if it was dropped.
  bool push(PeerId peer, Bytes payload);
  // Every queued notification, oldest first; the queue is then empty.
  std::vector<Notification> take();
  // take(), after waiting up to `timeout` for at least one.
  std::vector<Notification> wait(std::chrono::milliseconds timeout);

  uint64_t queued_bytes() const;  // payloads plus kEntryOverhead each
  uint64_t dropped() const;       // notifications dropped at the bound, ever

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Notification> queue_;
  uint64_t max_bytes_;
  uint64_t bytes_ = 0;
  uint64_t dropped_ = 0;
  LogLimiter drop_log_{"ferry engine: notifications dropped at the queue's bound", 1,
                       std::chrono::seconds(10)};
};

}  // namespace ferry
