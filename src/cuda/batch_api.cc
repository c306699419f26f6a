// cudaMemcpyBatchAsync with the signature of the runtime we compile against:
// 12.8 and 12.9 take a `size_t* failIdx` before the stream, 13.0 dropped it;
// before 12.8 there is no batch API and we loop over cudaMemcpyAsync.
#include "cuda/batch_api.h"

#include <cstdlib>
#include <string>

#include "cuda/cuda_util.h"

namespace ferry::cuda {
namespace {

Status memcpy_loop(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                   cudaStream_t stream) {
  for (size_t i = 0; i < count; ++i) {
    cudaError_t e = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream);
    if (e != cudaSuccess) {
      cudaGetLastError();
      Status s = cuda_status(e, "cudaMemcpyAsync");
      return Status(s.code(), "copy-engine block " + std::to_string(i) + ": " + s.message());
    }
  }
  return Status::Ok();
}

}  // namespace

bool batch_api_compiled() {
#if CUDART_VERSION >= 12080
  return true;
#else
  return false;
#endif
}

Status memcpy_batch(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                    bool use_batch_api, cudaStream_t stream) {
  if (count == 0) return Status::Ok();
#if CUDART_VERSION >= 12080
  // One block: cudaMemcpyAsync, which cost the host ~1.5 us less than a
  // batch of one (ferry-cuda-ipc-bench --trace, 2 x H100).
  // FERRY_COPY_BATCH_OF_ONE=1 (measurement only): the batch call for it too.
  static const bool batch_of_one = [] {
    const char* v = std::getenv("FERRY_COPY_BATCH_OF_ONE");
    return v != nullptr && *v == '1';
  }();
  if (use_batch_api && (count > 1 || batch_of_one)) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
    cudaError_t e = cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &attr_idx, 1, stream);
    const size_t fail_idx = SIZE_MAX;
#else
    size_t fail_idx = SIZE_MAX;
    cudaError_t e = cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs),
                                         const_cast<size_t*>(sizes), count, &attr, &attr_idx, 1,
                                         &fail_idx, stream);
#endif
    if (e == cudaSuccess) return Status::Ok();
    cudaGetLastError();
    (void)fail_idx;
    // The batch call refuses the whole batch (nothing enqueued) for a driver
    // too old or a combination it does not take (e.g. host to host); the
    // loop then either does the job or names the exact block that fails.
  }
#else
  (void)use_batch_api;
#endif
  return memcpy_loop(dsts, srcs, sizes, count, stream);
}

}  // namespace ferry::cuda
