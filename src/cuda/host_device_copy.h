// Copies between host memory and GPU memory, done before the call returns,
// for transports that stage GPU memory through host memory they share with
// another process (shm's staging areas): pin such an area with the CUDA
// runtime so that the copy engine reaches it directly, and copy a list of
// pieces, each between one host range and one GPU's memory.
//
// Each calling thread keeps one non-blocking stream per device: the copies
// of one call are queued on the streams of their devices and waited for
// together, and never wait for (or hold up) the application's work on the
// legacy default stream.
#pragma once

#include <cstdint>
#include <span>

#include "ferry/status.h"

namespace ferry {
class DefaultStreamMark;
}

namespace ferry {

// Pins [data, data + bytes) for every GPU of this process
// (cudaHostRegisterPortable), so copies to and from it run on the copy
// engine at full rate. NotSupported without CUDA or a usable GPU.
Status cuda_pin_host_range(void* data, uint64_t bytes);
// Undoes cuda_pin_host_range (before the range is unmapped).
void cuda_unpin_host_range(void* data);

// One copy between host memory and GPU memory of `device` (this process's
// ordinal). `to_device`: host → device, else device → host.
struct HostDeviceCopy {
  void* device_memory = nullptr;
  void* host_memory = nullptr;
  uint64_t bytes = 0;
  int device = -1;
  bool to_device = false;
};

// Queues every copy on the calling thread's stream of its device and waits
// for all of them. An error names the copy that failed (device, bytes).
// `after` (cuda/default_stream_mark.h), when given: the copies run after the
// work it marks on each device's legacy default stream -- a caller's
// cudaMemcpy from pageable memory returns before its DMA into GPU memory is
// done, and a copy out of that memory on another stream must wait for it.
Status cuda_copy_now(std::span<const HostDeviceCopy> copies,
                     const DefaultStreamMark* after = nullptr);

}  // namespace ferry
