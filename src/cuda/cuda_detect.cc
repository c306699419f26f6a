// Run-time detection of CUDA devices and of what kind of memory a pointer is.
//
// cudaPointerGetAttributes gives the type and owning device; the driver's
// cuPointerGetAttributes (reached through the runtime's entry-point lookup,
// so libferry does not link libcuda) adds allocation range, buffer id, IPC
// capability and mempool, which separate cudaMalloc from pool and VMM memory.
#include "cuda/cuda_detect.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <string>

#include "cuda/cuda_util.h"
#include "ferry/gpu.h"

namespace ferry {
namespace {

struct Availability {
  int count = 0;
  std::string reason;  // empty when count > 0
};

const Availability& availability() {
  static const Availability a = [] {
    Availability r;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear, so later calls don't see it
      r.reason = "no CUDA device: " + cuda::cuda_error_text(e, "cudaGetDeviceCount");
    } else if (n <= 0) {
      r.reason = "no CUDA device: cudaGetDeviceCount found 0 devices";
    } else {
      r.count = n;
    }
    return r;
  }();
  return a;
}

using PointerGetAttributesFn = CUresult (*)(unsigned int, CUpointer_attribute*, void**,
                                            CUdeviceptr);

// nullptr when the driver does not offer it; callers then do without ranges.
PointerGetAttributesFn pointer_get_attributes() {
  static const PointerGetAttributesFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &p, 12000,
                                                     cudaEnableDefault, &q);
#elif CUDART_VERSION >= 12000
    cudaError_t e = cudaGetDriverEntryPoint("cuPointerGetAttributes", &p, cudaEnableDefault, &q);
#else
    cudaError_t e = cudaGetDriverEntryPoint("cuPointerGetAttributes", &p, cudaEnableDefault);
    q = cudaDriverEntryPointSuccess;
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<PointerGetAttributesFn>(p);
  }();
  return fn;
}

}  // namespace

bool cuda_available(std::string* reason) {
  const Availability& a = availability();
  if (reason != nullptr) *reason = a.reason;
  return a.count > 0;
}

int cuda_device_count() {
  return availability().count;
}

#include "cuda/memory_type_names.inc"

Result<CudaPointerInfo> cuda_pointer_info(const void* ptr) {
  std::string reason;
  if (!cuda_available(&reason)) return err::NotSupported(reason);
  CudaPointerInfo info;
  if (ptr == nullptr) return info;  // pageable by convention; callers reject null first

  cudaPointerAttributes a{};
  cudaError_t e = cudaPointerGetAttributes(&a, ptr);
  if (e == cudaSuccess && a.type == cudaMemoryTypeHost && a.devicePointer == nullptr) {
    // The device address of pinned host memory is answered for the calling
    // thread's current context; a thread that has made no other CUDA call
    // has none (cudaGetDevice says 0, but nothing is bound), and the answer
    // is NULL even for cudaHostAllocMapped memory. Bind the primary context
    // of the thread's device (cudaSetDevice to the device it already names
    // changes nothing else) and ask again.
    int current = 0;
    if (cudaGetDevice(&current) == cudaSuccess && cudaSetDevice(current) == cudaSuccess) {
      e = cudaPointerGetAttributes(&a, ptr);
    }
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cuda::cuda_status(e, "cudaPointerGetAttributes");
  }
  switch (a.type) {
    case cudaMemoryTypeUnregistered:
      return info;  // pageable: nothing more to learn
    case cudaMemoryTypeHost:
      info.type = CudaMemoryType::kPinnedHost;
      break;
    case cudaMemoryTypeDevice:
      info.type = CudaMemoryType::kDevice;
      break;
    case cudaMemoryTypeManaged:
      info.type = CudaMemoryType::kManaged;
      break;
  }
  info.device = a.device;
  info.device_address = reinterpret_cast<uint64_t>(a.devicePointer);

  PointerGetAttributesFn fn = pointer_get_attributes();
  if (fn == nullptr) return info;
  CUpointer_attribute attrs[] = {
      CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
      CU_POINTER_ATTRIBUTE_BUFFER_ID,        CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
      CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
  };
  CUdeviceptr start = 0;
  size_t size = 0;
  unsigned long long buffer_id = 0;
  int ipc = 0;
  void* pool = nullptr;
  void* data[] = {&start, &size, &buffer_id, &ipc, &pool};
  if (fn(5, attrs, data, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) return info;
  info.base = start;
  info.size = size;
  info.buffer_id = buffer_id;
  info.ipc_capable = ipc != 0;
  // cudaMalloc memory is legacy-IPC capable; pool and cuMem (VMM) memory are not.
  if (info.type == CudaMemoryType::kDevice) {
    if (pool != nullptr) {
      info.type = CudaMemoryType::kDevicePool;
    } else if (!info.ipc_capable) {
      info.type = CudaMemoryType::kDeviceVmm;
    }
  }
  return info;
}

MemoryKindInfo cuda_detect_memory_kind(const void* ptr) {
  MemoryKindInfo k;
  Result<CudaPointerInfo> r = cuda_pointer_info(ptr);
  if (!r.ok()) return k;
  switch (r->type) {
    case CudaMemoryType::kDevice:
    case CudaMemoryType::kDevicePool:
    case CudaMemoryType::kDeviceVmm:
    case CudaMemoryType::kManaged:
      k.kind = MemoryKind::kCuda;
      k.device = r->device;
      k.gpu_pci = cuda_device_pci(r->device);
      break;
    case CudaMemoryType::kPageableHost:
    case CudaMemoryType::kPinnedHost:
      break;
  }
  return k;
}

}  // namespace ferry
