#include "cuda/staging_pool.h"

#include <cuda_runtime_api.h>

#include <string>

namespace ferry {

#include "cuda/staging_pool_common.inc"

Result<std::unique_ptr<StagingPool>> StagingPool::create(size_t slot_bytes, size_t slot_count) {
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    return err::NotSupported(std::string("GPU staging needs a CUDA device: cudaGetDeviceCount: ") +
                             (e == cudaSuccess ? "0 devices" : cudaGetErrorString(e)));
  }
  void* base = nullptr;
  // Portable: usable from every device's streams; mapped: the SM kernel may
  // read/write it directly.
  if (cudaError_t e = cudaHostAlloc(&base, slot_bytes * slot_count,
                                    cudaHostAllocPortable | cudaHostAllocMapped);
      e != cudaSuccess) {
    return err::Internal("cudaHostAlloc of " + std::to_string(slot_bytes * slot_count) +
                         " bytes for GPU staging failed: " + cudaGetErrorString(e));
  }
  return std::unique_ptr<StagingPool>(
      new StagingPool(static_cast<uint8_t*>(base), slot_bytes, slot_count, true));
}

StagingPool::~StagingPool() {
  if (owned_) cudaFreeHost(base_);
}

}  // namespace ferry
