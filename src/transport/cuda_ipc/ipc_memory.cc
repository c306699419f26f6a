#include "transport/cuda_ipc/ipc_memory.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <set>
#include <utility>

#include "cuda/cuda_detect.h"
#include "cuda/cuda_util.h"
#include "ferry/gpu.h"
#include "fmt/format.h"

namespace ferry::cuda_ipc {
namespace {

using cuda::cuda_status;

// Driver entry points, reached through the runtime so that libferry does not
// link libcuda (a machine without a driver still loads it).
void* driver_symbol(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
#else
  cudaError_t e = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &q);
#endif
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

struct Driver {
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*get_address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*retain_allocation_handle)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*export_to_shareable)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                  unsigned long long) = nullptr;
  CUresult (*import_from_shareable)(CUmemGenericAllocationHandle*, void*,
                                    CUmemAllocationHandleType) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                              unsigned long long) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  std::string missing;  // names of entry points not found

  bool vmm_ok() const { return missing.empty(); }
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    auto load = [&r](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(driver_symbol(name));
      if (fn == nullptr) r.missing += (r.missing.empty() ? "" : ", ") + std::string(name);
    };
    load(r.get_error_name, "cuGetErrorName");
    load(r.get_address_range, "cuMemGetAddressRange");
    load(r.retain_allocation_handle, "cuMemRetainAllocationHandle");
    load(r.export_to_shareable, "cuMemExportToShareableHandle");
    load(r.import_from_shareable, "cuMemImportFromShareableHandle");
    load(r.release, "cuMemRelease");
    load(r.address_reserve, "cuMemAddressReserve");
    load(r.address_free, "cuMemAddressFree");
    load(r.map, "cuMemMap");
    load(r.unmap, "cuMemUnmap");
    load(r.set_access, "cuMemSetAccess");
    return r;
  }();
  return d;
}

std::string cu_text(CUresult r, const char* what) {
  const char* name = nullptr;
  if (driver().get_error_name == nullptr || driver().get_error_name(r, &name) != CUDA_SUCCESS ||
      name == nullptr) {
    name = "unknown CUresult";
  }
  return fmt::format("{}: {} ({})", what, name, static_cast<int>(r));
}

Status cu_status(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return Status::Ok();
  if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_NOT_PERMITTED) {
    return err::NotSupported(cu_text(r, what));
  }
  if (r == CUDA_ERROR_INVALID_VALUE) return err::InvalidArgument(cu_text(r, what));
  return err::Internal(cu_text(r, what));
}

constexpr uint64_t kReserveAlignment = 2 << 20;

}  // namespace

Result<std::vector<Uuid>> visible_gpus() {
  static const Result<std::vector<Uuid>> gpus = []() -> Result<std::vector<Uuid>> {
    std::string reason;
    if (!cuda_available(&reason)) return err::NotSupported(reason);
    std::vector<Uuid> out;
    for (int i = 0; i < cuda_device_count(); ++i) {
      cudaDeviceProp prop{};
      if (cudaError_t e = cudaGetDeviceProperties(&prop, i); e != cudaSuccess) {
        cudaGetLastError();
        return cuda_status(e, "cudaGetDeviceProperties");
      }
      Uuid u{};
      std::memcpy(u.data(), prop.uuid.bytes, u.size());
      out.push_back(u);
    }
    return out;
  }();
  return gpus;
}

int ordinal_of(const Uuid& uuid) {
  auto gpus = visible_gpus();
  if (!gpus.ok()) return -1;
  for (size_t i = 0; i < gpus->size(); ++i) {
    if ((*gpus)[i] == uuid) return static_cast<int>(i);
  }
  return -1;
}

ExportedMemory::ExportedMemory(ExportedMemory&& other) noexcept
    : grant(std::move(other.grant)), fds(std::move(other.fds)) {
  other.fds.clear();
}

ExportedMemory::~ExportedMemory() {
  for (int fd : fds) ::close(fd);
}

Result<ExportedMemory> export_memory(const void* address, uint64_t length) {
  auto info = cuda_pointer_info(address);
  if (!info.ok()) return info.status();
  auto gpus = visible_gpus();
  if (!gpus.ok()) return gpus.status();
  if (info->device < 0 || static_cast<size_t>(info->device) >= gpus->size()) {
    return err::Internal(
        fmt::format("cuda_ipc: {} reports device {} of {}", address, info->device, gpus->size()));
  }
  cuda::DeviceGuard guard(info->device);
  ExportedMemory out;
  Grant& g = out.grant;
  g.gpu_uuid = (*gpus)[static_cast<size_t>(info->device)];
  g.buffer_id = info->buffer_id;
  g.region_address = reinterpret_cast<uint64_t>(address);
  const uint64_t begin = g.region_address;
  const uint64_t end = begin + length;

  switch (info->type) {
    case CudaMemoryType::kDevice: {
      if (info->base == 0 || begin < info->base || end > info->base + info->size) {
        return err::Internal(
            fmt::format("cuda_ipc: region [{:#x}, +{}) is not inside its allocation [{:#x}, +{})",
                        begin, length, info->base, info->size));
      }
      cudaIpcMemHandle_t h{};
      if (cudaError_t e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(info->base));
          e != cudaSuccess) {
        cudaGetLastError();
        return cuda_status(e, "cudaIpcGetMemHandle");
      }
      g.kind = HandleKind::kLegacy;
      g.span_base = info->base;
      g.span_length = info->size;
      Piece p;
      p.offset = 0;
      p.length = info->size;
      static_assert(sizeof(h) == kLegacyHandleBytes);
      std::memcpy(p.handle.data(), &h, sizeof h);
      g.pieces.push_back(p);
      return out;
    }
    case CudaMemoryType::kDeviceVmm: {
      const Driver& d = driver();
      if (!d.vmm_ok()) {
        return err::NotSupported("cuda_ipc: the driver lacks " + d.missing);
      }
      g.kind = HandleKind::kVmm;
      uint64_t at = begin;
      while (at < end) {
        CUdeviceptr piece_base = 0;
        size_t piece_size = 0;
        if (CUresult r = d.get_address_range(&piece_base, &piece_size, at); r != CUDA_SUCCESS) {
          return cu_status(r, "cuMemGetAddressRange");
        }
        if (piece_size == 0 || piece_base > at || at - piece_base >= piece_size) {
          return err::Internal(
              fmt::format("cuda_ipc: cuMemGetAddressRange({:#x}) gave [{:#x}, +{})", at, piece_base,
                          piece_size));
        }
        if (g.pieces.empty()) {
          g.span_base = piece_base;
        } else if (piece_base != g.span_base + g.span_length) {
          return err::Internal(
              fmt::format("cuda_ipc: VMM piece at {:#x} does not follow the "
                          "previous one, which ends at {:#x}",
                          piece_base, g.span_base + g.span_length));
        }
        if (g.pieces.size() >= kMaxPieces) {
          return err::NotSupported(
              fmt::format("cuda_ipc: region [{:#x}, +{}) spans more than {} VMM allocations", begin,
                          length, kMaxPieces));
        }
        CUmemGenericAllocationHandle h = 0;
        if (CUresult r = d.retain_allocation_handle(&h, reinterpret_cast<void*>(at));
            r != CUDA_SUCCESS) {
          return cu_status(r, "cuMemRetainAllocationHandle");
        }
        int fd = -1;
        CUresult r = d.export_to_shareable(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        d.release(h);  // the descriptor holds its own reference
        if (r != CUDA_SUCCESS) {
          Status s = cu_status(r, "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)");
          return Status(s.code(), s.message() +
                                      ": the VMM allocation was created without "
                                      "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in "
                                      "requestedHandleTypes, so no other process can map it");
        }
        out.fds.push_back(fd);
        Piece p;
        p.offset = piece_base - g.span_base;
        p.length = piece_size;
        g.pieces.push_back(p);
        g.span_length += piece_size;
        at = piece_base + piece_size;
      }
      return out;
    }
    case CudaMemoryType::kDevicePool:
      return err::NotSupported(
          "cuda_ipc: stream-ordered pool memory (cudaMallocAsync) cannot be shared by IPC "
          "handle; allocate with cudaMalloc or cuMemCreate (POSIX file descriptor handles)");
    case CudaMemoryType::kManaged:
      return err::NotSupported("cuda_ipc: managed memory (cudaMallocManaged) cannot be shared");
    case CudaMemoryType::kPinnedHost:
    case CudaMemoryType::kPageableHost:
      break;
  }
  return err::InvalidArgument(fmt::format("cuda_ipc: {} is host memory, not GPU memory", address));
}

Result<std::shared_ptr<Mapping>> Mapping::import(const Grant& g, std::vector<int> fds,
                                                 bool same_process, int access_device) {
  struct CloseFds {
    std::vector<int>& fds;
    ~CloseFds() {
      for (int fd : fds) ::close(fd);
    }
  } close_fds{fds};

  // The memory's GPU may be one this process does not see (each serving
  // worker launched with CUDA_VISIBLE_DEVICES naming only its own GPU). The
  // driver maps it all the same: cudaIpcOpenMemHandle "can open handles to
  // devices that may not be visible in the process calling the API" (enabling
  // peer access lazily, as for a visible GPU), and a cuMem allocation imported
  // from its descriptor is mapped and opened to the GPUs we name in
  // cuMemSetAccess. Copies then run on the GPU that opened it.
  const int device = ordinal_of(g.gpu_uuid);
  std::shared_ptr<Mapping> m(new Mapping());
  m->device_ = device;
  m->access_device_ = access_device >= 0 ? access_device : device >= 0 ? device : current_device();
  m->kind_ = g.kind;
  m->length_ = g.span_length;
  if (same_process) {
    // Two engines of one process: the exporter's addresses are ours.
    m->base_ = reinterpret_cast<uint8_t*>(g.span_base);
    return m;
  }
  const bool legacy = g.kind == HandleKind::kLegacy;
  cuda::DeviceGuard guard(legacy || device < 0 ? m->access_device_ : device);
  if (guard.status() != cudaSuccess) return cuda_status(guard.status(), "cudaSetDevice");

  if (legacy) {
    if (!fds.empty()) return err::ProtocolError("cuda_ipc: descriptors sent with a legacy grant");
    cudaIpcMemHandle_t h{};
    std::memcpy(&h, g.pieces[0].handle.data(), sizeof h);
    void* p = nullptr;
    if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        e != cudaSuccess) {
      cudaGetLastError();
      return device >= 0 ? cuda_status(e, "cudaIpcOpenMemHandle")
                         : cuda_status(e, fmt::format("cudaIpcOpenMemHandle of memory on {}, "
                                                      "which this process does not see, in GPU "
                                                      "{}'s context",
                                                      uuid_text(g.gpu_uuid), m->access_device_)
                                              .c_str());
    }
    m->base_ = static_cast<uint8_t*>(p);
    m->owned_ = true;
    return m;
  }

  const Driver& d = driver();
  if (!d.vmm_ok()) return err::NotSupported("cuda_ipc: the driver lacks " + d.missing);
  if (fds.size() != g.pieces.size()) {
    return err::ProtocolError(
        fmt::format("cuda_ipc: VMM grant of {} pieces came with {} "
                    "descriptors",
                    g.pieces.size(), fds.size()));
  }
  CUdeviceptr va = 0;
  if (CUresult r = d.address_reserve(&va, g.span_length, kReserveAlignment, 0, 0);
      r != CUDA_SUCCESS) {
    return cu_status(r, "cuMemAddressReserve");
  }
  m->base_ = reinterpret_cast<uint8_t*>(va);
  m->owned_ = true;  // from here the destructor unmaps what was mapped and frees the range
  for (size_t i = 0; i < g.pieces.size(); ++i) {
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d.import_from_shareable(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fds[i])),
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) return cu_status(r, "cuMemImportFromShareableHandle");
    m->vmm_.push_back(h);
    r = d.map(va + g.pieces[i].offset, g.pieces[i].length, 0, h, 0);
    if (r != CUDA_SUCCESS) return cu_status(r, "cuMemMap");
    m->vmm_ranges_.emplace_back(g.pieces[i].offset, g.pieces[i].length);
  }
  // Read/write for the memory's own GPU and every GPU that can reach it; for
  // memory on a GPU we do not see, for the GPU that copies (no visible GPU
  // can be asked about peer access to an invisible one: the driver answers
  // by refusing cuMemSetAccess).
  std::vector<CUmemAccessDesc> access;
  for (int other = 0; other < cuda_device_count(); ++other) {
    int can = other == device ? 1 : 0;
    if (device < 0) {
      can = other == m->access_device_ ? 1 : 0;
    } else if (other != device && cudaDeviceCanAccessPeer(&can, other, device) != cudaSuccess) {
      cudaGetLastError();
      can = 0;
    }
    if (can == 0) continue;
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = other;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access.push_back(a);
  }
  if (CUresult r = d.set_access(va, g.span_length, access.data(), access.size());
      r != CUDA_SUCCESS) {
    Status s = cu_status(r, "cuMemSetAccess");
    if (device >= 0) return s;
    return Status(s.code(), fmt::format("{} (memory on {}, which this process does not see, "
                                        "opened to GPU {})",
                                        s.message(), uuid_text(g.gpu_uuid), m->access_device_));
  }
  return m;
}

Mapping::~Mapping() {
  if (!owned_ || base_ == nullptr) return;
  cuda::DeviceGuard guard(kind_ == HandleKind::kLegacy || device_ < 0 ? access_device_ : device_);
  if (kind_ == HandleKind::kLegacy) {
    if (cudaIpcCloseMemHandle(base_) != cudaSuccess) cudaGetLastError();
    return;
  }
  const Driver& d = driver();
  const auto va = reinterpret_cast<CUdeviceptr>(base_);
  for (const auto& [offset, length] : vmm_ranges_) d.unmap(va + offset, length);
  for (auto h : vmm_) d.release(h);
  d.address_free(va, length_);
}

int current_device() {
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return d;
}

Status sync_default_stream(int device) {
  cuda::DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return cuda_status(guard.status(), "cudaSetDevice");
  if (cudaError_t e = cudaStreamSynchronize(cudaStreamLegacy); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "cudaStreamSynchronize(default stream)");
  }
  return Status::Ok();
}

Status ensure_peer_access(int from, int to) {
  if (from == to) return Status::Ok();
  static std::mutex mu;
  static std::set<std::pair<int, int>> enabled;
  std::lock_guard lock(mu);
  if (enabled.count({from, to}) != 0) return Status::Ok();
  cuda::DeviceGuard guard(from);
  cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
    e = cudaSuccess;
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, fmt::format("cudaDeviceEnablePeerAccess({} -> {})", from, to).c_str());
  }
  enabled.insert({from, to});
  return Status::Ok();
}

}  // namespace ferry::cuda_ipc
