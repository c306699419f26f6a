// Run-time CUDA detection and pointer classification.
//
// The core installs cuda_detect_memory_kind with set_memory_kind_detector so
// that register_memory records GPU memory as such; cuda_pointer_info gives the
// rest (allocation base, buffer id, how it was allocated) for the cuda_ipc
// mapping cache and for the copy path's pinned/pageable check.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/region_registry.h"  // MemoryKindInfo
#include "ferry/status.h"

namespace ferry {

enum class CudaMemoryType : uint8_t {
  kPageableHost = 0,  // plain malloc/mmap memory, unknown to CUDA
  kPinnedHost,        // cudaHostAlloc / cudaMallocHost / cudaHostRegister
  kDevice,            // cudaMalloc / cuMemAlloc
  kDevicePool,        // cudaMallocAsync / cudaMallocFromPoolAsync
  kDeviceVmm,         // cuMemCreate + cuMemMap (virtual memory management)
  kManaged,           // cudaMallocManaged
};
std::string_view cuda_memory_type_name(CudaMemoryType type);

struct CudaPointerInfo {
  CudaMemoryType type = CudaMemoryType::kPageableHost;
  int device = -1;              // owning device; for pinned host, where it was registered
  uint64_t base = 0;            // allocation (or VMM reservation) start; 0 if unknown
  uint64_t size = 0;            // its size; 0 if unknown
  uint64_t buffer_id = 0;       // process-unique id of the allocation; 0 if none
  uint64_t device_address = 0;  // address kernels use for this pointer; 0 if not mapped
  bool ipc_capable = false;     // usable with cudaIpcGetMemHandle
};

// Classifies `ptr`. NotSupported without CUDA support or a usable device.
Result<CudaPointerInfo> cuda_pointer_info(const void* ptr);

// The PCI bus id of this process's GPU `ordinal`, packed (pack_pci_bus_id);
// 0 when there is no such GPU.
uint32_t cuda_device_pci(int ordinal);

// For set_memory_kind_detector: kCuda (+ device) for device, pool, VMM and
// managed memory, with the GPU's PCI bus id; kHost for pinned and pageable host memory and whenever
// CUDA is unavailable. Never fails.
MemoryKindInfo cuda_detect_memory_kind(const void* ptr);

}  // namespace ferry
