// A fixed pool of pinned host buffers ("slots") through which host-only
// transports move GPU memory: device → slot → wire, wire → slot → device.
// Pinned so that the copy engine and the SM kernel can reach them directly.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
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
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  size_t slot_bytes() const { return slot_bytes_; }
  // Waits for a free slot up to `timeout` (Busy then: every slot is in use).
  Result<std::unique_ptr<StagingSlot>> acquire(std::chrono::milliseconds timeout);

 private:
  friend class StagingSlot;
  StagingPool(uint8_t* base, size_t slot_bytes, size_t slot_count);
  void release(uint8_t* slot);

  uint8_t* base_;
  size_t slot_bytes_;
  size_t slot_count_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t*> free_;
};

}  // namespace ferry
