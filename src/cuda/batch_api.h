// Copy-engine path: many (dst, src, size) copies enqueued in one call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "ferry/status.h"

namespace ferry::cuda {

// True when this build can call cudaMemcpyBatchAsync (CUDA runtime >= 12.8).
bool batch_api_compiled();

// Enqueues `count` copies on `stream` (not the legacy default stream). With
// `use_batch_api` and CUDA >= 12.8: one cudaMemcpyBatchAsync; otherwise, or
// if the batch call refuses the batch, one cudaMemcpyAsync(cudaMemcpyDefault)
// per copy. Source accesses are stream ordered. Errors name the failing
// block's index; blocks before it may already be enqueued.
Status memcpy_batch(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                    bool use_batch_api, cudaStream_t stream);

}  // namespace ferry::cuda
