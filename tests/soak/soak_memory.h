// The memory a soak process moves: host memory, or GPU memory (--memory gpu)
// seen through a host shadow. The engine is given data(); the soak fills and
// checks patterns in host() and moves the bytes between the two around each
// transfer: ToMemory() before a write is posted (and after a sentinel is
// laid), FromMemory() before what arrived is checked. For host memory both
// are the same bytes and the moves do nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "soak_config.h"

namespace ferry::soak {

class SoakMemory {
 public:
  virtual ~SoakMemory() = default;
  // `size` bytes of the kind `config.memory` names (GPU memory on `device`,
  // SelectGpu()'s answer); nullptr (and `error`) when it cannot be had.
  static std::unique_ptr<SoakMemory> Create(const SoakConfig& config, int device, uint64_t size,
                                            std::string* error);
  uint8_t* data() const { return data_; }  // what is registered and transferred
  uint8_t* host() const { return host_; }  // where patterns are written and checked
  uint64_t size() const { return size_; }
  // host()[offset, +length) -> data(), and back; complete when they return.
  // false (and `error`) when the copy failed.
  virtual bool ToMemory(uint64_t offset, uint64_t length, std::string* error) = 0;
  virtual bool FromMemory(uint64_t offset, uint64_t length, std::string* error) = 0;

 protected:
  uint8_t* data_ = nullptr;
  uint8_t* host_ = nullptr;
  uint64_t size_ = 0;
};

// GPU memory (soak_memory_cuda.cc; soak_memory_no_cuda.cc where Ferry is
// built without CUDA, which answers with the reason).
std::unique_ptr<SoakMemory> CreateGpuMemory(int device, uint64_t size, std::string* error);
// GPUs this process sees (the coordinator's count, passed to the workers as
// --gpus); -1 and `error` when CUDA does not answer.
int CountGpus(std::string* error);
// Worker `index`'s GPU: i % gpus of those visible. With config.gpu_isolate
// the worker is first given that GPU alone (CUDA_VISIBLE_DEVICES, before CUDA
// starts in the process, as serving stacks launch their workers) and it is
// then device 0. Returns the device ordinal for this process, or -1 (error).
int SelectGpu(const SoakConfig& config, int index, std::string* error);

}  // namespace ferry::soak
