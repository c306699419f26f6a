// Shared helpers of the GPU tests: skip without a device, RAII buffers of
// each memory kind, CUDA call checks.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "ferry/gpu.h"

namespace ferry::testing {

#define FERRY_CUDA_OK(expr)                                                    \
  do {                                                                         \
    cudaError_t e_ = (expr);                                                   \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorName(e_) << " " \
                               << cudaGetErrorString(e_);                      \
  } while (0)

// Base fixture: skips, with the reason, where no GPU answers.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    if (!cuda_available(&reason)) GTEST_SKIP() << "skipped: " << reason;
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
};

// Queues `rounds` memsets of `scratch` (`bytes` of device memory) on the
// legacy default stream, so that work queued there next runs well after the
// call that follows: what a test of ordering after the default stream needs.
inline void keep_default_stream_busy(void* scratch, size_t bytes, int rounds = 8) {
  for (int i = 0; i < rounds; ++i) FERRY_CUDA_OK(cudaMemsetAsync(scratch, i, bytes, 0));
}

enum class Mem { kDevice, kPinned, kRegistered, kPageable, kManaged };

inline const char* mem_name(Mem m) {
  switch (m) {
    case Mem::kDevice:
      return "device";
    case Mem::kPinned:
      return "pinned";
    case Mem::kRegistered:
      return "registered";
    case Mem::kPageable:
      return "pageable";
    case Mem::kManaged:
      return "managed";
  }
  return "?";
}

// A buffer of one memory kind; bytes are read/written through upload/download.
class Buffer {
 public:
  Buffer(Mem kind, size_t n) : kind_(kind), n_(n) {
    cudaError_t e = cudaSuccess;
    switch (kind) {
      case Mem::kDevice:
        e = cudaMalloc(&p_, n);
        break;
      case Mem::kPinned:
        e = cudaHostAlloc(&p_, n, cudaHostAllocDefault);
        break;
      case Mem::kManaged:
        e = cudaMallocManaged(&p_, n);
        break;
      case Mem::kRegistered:
        p_ = std::aligned_alloc(4096, (n + 4095) / 4096 * 4096);
        e = cudaHostRegister(p_, n, cudaHostRegisterDefault);
        break;
      case Mem::kPageable:
        p_ = std::malloc(n);
        break;
    }
    ok_ = e == cudaSuccess && p_ != nullptr;
  }
  ~Buffer() {
    switch (kind_) {
      case Mem::kDevice:
      case Mem::kManaged:
        cudaFree(p_);
        break;
      case Mem::kPinned:
        cudaFreeHost(p_);
        break;
      case Mem::kRegistered:
        cudaHostUnregister(p_);
        std::free(p_);
        break;
      case Mem::kPageable:
        std::free(p_);
        break;
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  bool ok() const { return ok_; }
  uint8_t* data() const { return static_cast<uint8_t*>(p_); }
  size_t size() const { return n_; }
  Mem kind() const { return kind_; }
  // Complete on return: a pageable-source cudaMemcpy may still be in flight
  // otherwise, and CopyStream's stream does not wait for the legacy stream.
  void upload(const void* from) {
    ASSERT_EQ(cudaMemcpy(p_, from, n_, cudaMemcpyDefault), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  void download(void* to) const {
    ASSERT_EQ(cudaMemcpy(to, p_, n_, cudaMemcpyDefault), cudaSuccess);
  }

 private:
  Mem kind_;
  size_t n_;
  void* p_ = nullptr;
  bool ok_ = false;
};

}  // namespace ferry::testing
