// Exporting GPU memory to another process and mapping what a peer exported:
// the CUDA half of the cuda_ipc transport.
//
// Export covers whole allocations, because that is what CUDA shares: for
// cudaMalloc memory the allocation's base gets a legacy IPC handle; for VMM
// (cuMemCreate + cuMemMap, e.g. PyTorch's expandable segments) every physical
// allocation backing the range is exported as a POSIX file descriptor. The
// importer lays the pieces out again in one reservation, so (span base +
// offset) addresses the same byte in both processes. A region inside a larger
// allocation (a caching allocator's sub-allocation) is reached as (allocation,
// offset).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ferry/status.h"
#include "transport/cuda_ipc/cuda_ipc_wire.h"

namespace ferry::cuda_ipc {

using Uuid = std::array<uint8_t, kUuidBytes>;

// UUIDs of the GPUs this process sees, by ordinal. NotSupported without a
// usable device.
Result<std::vector<Uuid>> visible_gpus();
// This process's ordinal of the GPU `uuid`, or -1 if it does not see it.
int ordinal_of(const Uuid& uuid);

// The grant body (everything but request id and status) for
// [address, address + length) of GPU memory, plus the descriptors of its VMM
// pieces. Descriptors are closed when this is destroyed.
struct ExportedMemory {
  Grant grant;
  std::vector<int> fds;
  ExportedMemory() = default;
  ExportedMemory(ExportedMemory&& other) noexcept;
  ExportedMemory& operator=(ExportedMemory&&) = delete;
  ~ExportedMemory();
};
Result<ExportedMemory> export_memory(const void* address, uint64_t length);

// A peer's memory mapped into this process. Unmapped (handle closed, VMM
// reservation released) when the last reference goes.
class Mapping {
 public:
  // `fds`: one per VMM piece, consumed (closed) here whatever the outcome.
  // `same_process`: the peer is this process -- its addresses are ours.
  // `access_device`: the GPU whose kernels and copies will use the mapping
  // (-1: the memory's own). A legacy handle is opened in that GPU's context:
  // opened in the memory GPU's context instead, another GPU's kernels fault
  // on it and its copy engine goes through host memory (38 GB/s instead of
  // NVLink's ~390 GB/s on 2 x H200). VMM mappings are open to every GPU with
  // peer access. Memory on a GPU this process does not see is opened to
  // `access_device` alone (-1: the calling thread's current GPU).
  static Result<std::shared_ptr<Mapping>> import(const Grant& grant, std::vector<int> fds,
                                                 bool same_process, int access_device = -1);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  // Where the exporter's span_base lies here.
  uint8_t* base() const { return base_; }
  uint64_t length() const { return length_; }
  // This process's ordinal of the GPU holding the memory; -1 when this
  // process does not see that GPU (CUDA_VISIBLE_DEVICES): then only the GPU
  // that opened the mapping (copy_device()) copies to and from it.
  int device() const { return device_; }
  bool device_visible() const { return device_ >= 0; }
  // Whether copies run by `gpu`'s streams may use the mapping.
  bool usable_from(int gpu) const {
    if (base_ == nullptr || !owned_) return true;
    if (kind_ == HandleKind::kVmm && device_ >= 0) return true;
    return gpu == access_device_;
  }
  // The GPU whose streams copy between this mapping and host memory.
  int host_copy_device() const {
    return kind_ == HandleKind::kVmm && device_ >= 0 ? device_ : access_device_;
  }
  HandleKind kind() const { return kind_; }

 private:
  Mapping() = default;
  uint8_t* base_ = nullptr;
  uint64_t length_ = 0;
  int device_ = -1;
  int access_device_ = -1;  // legacy handles: the context they were opened in
  HandleKind kind_ = HandleKind::kLegacy;
  bool owned_ = false;                   // false: the peer's memory is our own
  std::vector<unsigned long long> vmm_;  // imported CUmemGenericAllocationHandle per piece
  std::vector<std::pair<uint64_t, uint64_t>> vmm_ranges_;  // mapped (offset, length)
};

// Waits for work queued on `device`'s legacy default stream: a copy another
// process makes from (or into) our memory cannot be ordered after it on the GPU.
Status sync_default_stream(int device);

// The calling thread's current GPU (cudaGetDevice), 0 if CUDA cannot say: the
// GPU a process works on, where a peer's memory is mapped for copies from host
// memory (Mapping::import).
int current_device();

// Lets kernels and copies on `from` reach memory of `to` (cudaDeviceEnablePeerAccess,
// once per pair). Ok when they are the same device.
Status ensure_peer_access(int from, int to);

}  // namespace ferry::cuda_ipc
