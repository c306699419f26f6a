#include "cuda/host_device_copy.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "cuda/cuda_util.h"
#include "cuda/default_stream_mark.h"
#include "fmt/format.h"

namespace ferry {
namespace {

// The calling thread's non-blocking stream of each device, created on first
// use and destroyed when the thread ends.
class ThreadStreams {
 public:
  ~ThreadStreams() {
    for (size_t d = 0; d < streams_.size(); ++d) {
      if (streams_[d] == nullptr) continue;
      cuda::DeviceGuard guard(static_cast<int>(d));
      cudaStreamDestroy(streams_[d]);
    }
  }
  Result<cudaStream_t> of(int device) {
    if (device < 0) return err::InvalidArgument(fmt::format("no GPU {}", device));
    if (static_cast<size_t>(device) >= streams_.size()) streams_.resize(device + 1, nullptr);
    if (streams_[device] == nullptr) {
      cuda::DeviceGuard guard(device);
      if (guard.status() != cudaSuccess) {
        return cuda::cuda_status(guard.status(), "cudaSetDevice");
      }
      cudaStream_t s = nullptr;
      if (cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); e != cudaSuccess) {
        return cuda::cuda_status(e, "cudaStreamCreateWithFlags");
      }
      streams_[device] = s;
    }
    return streams_[device];
  }

 private:
  std::vector<cudaStream_t> streams_;
};

}  // namespace

Status cuda_pin_host_range(void* data, uint64_t bytes) {
  const cudaError_t e = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
  if (e == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // not sticky: leave no error for the application's next call
  return cuda::cuda_status(e, "cudaHostRegister");
}

void cuda_unpin_host_range(void* data) {
  if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
}

Status cuda_copy_now(std::span<const HostDeviceCopy> copies, const DefaultStreamMark* after) {
  thread_local ThreadStreams streams;
  std::vector<std::pair<int, cudaStream_t>> used;
  Status first;
  for (const HostDeviceCopy& c : copies) {
    auto stream = streams.of(c.device);
    if (!stream.ok()) {
      first = Status(stream.status().code(),
                     fmt::format("GPU {}: {}", c.device, stream.status().message()));
      break;
    }
    cuda::DeviceGuard guard(c.device);
    bool seen = false;
    for (const auto& u : used) seen = seen || u.second == *stream;
    if (!seen && after != nullptr) {
      if (Status s = after->order(c.device, *stream); !s.ok()) {
        first = Status(s.code(), fmt::format("GPU {}: {}", c.device, s.message()));
        break;
      }
    }
    const cudaError_t e = c.to_device ? cudaMemcpyAsync(c.device_memory, c.host_memory, c.bytes,
                                                        cudaMemcpyHostToDevice, *stream)
                                      : cudaMemcpyAsync(c.host_memory, c.device_memory, c.bytes,
                                                        cudaMemcpyDeviceToHost, *stream);
    if (e != cudaSuccess) {
      first = cuda::cuda_status(
          e, c.to_device ? "cudaMemcpyAsync (host to device)" : "cudaMemcpyAsync (device to host)");
      first = Status(first.code(),
                     fmt::format("{} of {} bytes on GPU {}", first.message(), c.bytes, c.device));
      break;
    }
    if (!seen) used.emplace_back(c.device, *stream);
  }
  // Wait even after a failure: copies already queued still touch the memory.
  for (const auto& [device, stream] : used) {
    cuda::DeviceGuard guard(device);
    if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess && first.ok()) {
      first = cuda::cuda_status(e, "cudaStreamSynchronize");
      first = Status(first.code(), fmt::format("{} on GPU {}", first.message(), device));
    }
  }
  return first;
}

}  // namespace ferry
