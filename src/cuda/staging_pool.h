// A fixed pool of pinned host buffers ("slots") through which host-only
// transports move GPU memory: device → slot → wire, wire → slot → device.
// Pinned so that the copy engine and the SM kernel can reach them directly.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "ferry/status.h"

namespace ferry {

class StagingPool;

// One slot, returned to its pool when destroyed.
class StagingSlot {
 public:
  StagingSlot(StagingPool* pool, uint8_t* data) : pool_(pool), data_(data) {}
  ~StagingSlot();
  StagingSlot(const StagingSlot&) = delete;
  StagingSlot& operator=(const StagingSlot&) = delete;
  uint8_t* data() const { return data_; }

 private:
  StagingPool* pool_;
  uint8_t* data_;
};

class StagingPool {
 public:
  // NotSupported without CUDA or a device; the error says why.
  static Result<std::unique_ptr<StagingPool>> create(size_t slot_bytes, size_t slot_count);
  // A pool over memory the caller owns and keeps valid (and pinned, where
  // devices copy to it) for the pool's life; it is not freed by the pool.
  static std::unique_ptr<StagingPool> over(uint8_t* base, size_t slot_bytes, size_t slot_count);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  size_t slot_bytes() const { return slot_bytes_; }
  // Every slot lies in [base(), base() + slot_bytes() * slot_count()): a
  // transport may register that range with its network once.
  uint8_t* base() const { return base_; }
  size_t slot_count() const { return slot_count_; }

  using Waiter = std::function<void(std::unique_ptr<StagingSlot>)>;
  // A free slot at once, or null after queuing `later`. Nobody ever waits
  // in here: the slot a release frees goes to the oldest queued waiter,
  // called on the releasing thread with no lock of the pool held -- so
  // `later` should only hand the slot on (the releaser may hold its own
  // locks). `later` may run before this call returns. A slot is never
  // taken past a queued waiter.
  std::unique_ptr<StagingSlot> acquire_or_queue(Waiter later);
  // Forgets the queued waiters without calling them (shutdown).
  void drop_waiters();
  size_t free_slots();
  size_t waiters();

 private:
  friend class StagingSlot;
  StagingPool(uint8_t* base, size_t slot_bytes, size_t slot_count, bool owned);
  void release(uint8_t* slot);

  uint8_t* base_;
  size_t slot_bytes_;
  size_t slot_count_;
  bool owned_;  // allocated by create(): freed with the pool
  std::mutex mu_;
  std::vector<uint8_t*> free_;  // last released first: its bytes are the likeliest in cache
  std::deque<Waiter> waiters_;
};

}  // namespace ferry
