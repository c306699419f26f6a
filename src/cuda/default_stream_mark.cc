#include "cuda/default_stream_mark.h"

#include <algorithm>
#include <string>

#include "cuda/cuda_util.h"

namespace ferry {

Result<std::shared_ptr<DefaultStreamMark>> DefaultStreamMark::take(std::span<const int> devices) {
  std::shared_ptr<DefaultStreamMark> mark(new DefaultStreamMark());
  for (int device : devices) {
    auto seen = [device](const auto& e) { return e.first == device; };
    if (std::any_of(mark->events_.begin(), mark->events_.end(), seen)) continue;
    cuda::DeviceGuard guard(device);
    if (guard.status() != cudaSuccess) return cuda::cuda_status(guard.status(), "cudaSetDevice");
    const cudaError_t q = cudaStreamQuery(cudaStreamLegacy);
    if (q == cudaSuccess) continue;  // idle: nothing queued there to wait for
    if (q != cudaErrorNotReady) {
      cudaGetLastError();
      return cuda::cuda_status(
          q, ("asking GPU " + std::to_string(device) + "'s default stream").c_str());
    }
    cudaEvent_t ev = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e == cudaSuccess) {
      mark->events_.emplace_back(device, ev);
      e = cudaEventRecord(ev, cudaStreamLegacy);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      return cuda::cuda_status(
          e, ("marking GPU " + std::to_string(device) + "'s default stream").c_str());
    }
  }
  if (mark->events_.empty()) return std::shared_ptr<DefaultStreamMark>();
  return mark;
}

DefaultStreamMark::~DefaultStreamMark() {
  // A stream still waiting for an event keeps it until then (CUDA releases
  // a destroyed event's resources once the device has completed it).
  for (auto& [device, ev] : events_) cudaEventDestroy(static_cast<cudaEvent_t>(ev));
}

Status DefaultStreamMark::order(int device, void* stream) const {
  for (const auto& [d, ev] : events_) {
    if (d != device) continue;
    cuda::DeviceGuard guard(device);
    const cudaError_t e =
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(ev), 0);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return cuda::cuda_status(e, "ordering a copy after the caller's default-stream work");
    }
  }
  return Status::Ok();
}

}  // namespace ferry
