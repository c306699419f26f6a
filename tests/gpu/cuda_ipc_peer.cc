// Target process for cuda_ipc_test: allocates, registers and advertises
// buffers of several kinds on command, and reports what its memory holds.
// Prints "ready META_HEX" and then answers one line per command on stdin:
//   alloc NAME KIND SIZE [OFF LEN]  KIND: malloc | vmm | pool | pinned | host;
//                                   registers [OFF, OFF+LEN) (default: all)
//                                   → "desc HEX ADDR" (ADDR: the registered start)
//   realloc NAME                    deregister, free, allocate the same again
//                                   → "desc HEX ADDR"
//   fill NAME SEED                  pattern(SEED) over the registered range → "ok"
//   sum NAME OFF LEN                FNV-1a of registered bytes [OFF, +LEN) → "sum N"
//   dereg NAME                      → "ok MILLISECONDS" (how long deregistration took)
//   notif TIMEOUT_MS                first notification → "notif PAYLOAD" or "none"
//   listen                          → "listen HOST:PORT" (where its tcp listens)
//   carrier PEER_HEX ROUTE          which transport carries ROUTE ("peer GPU memory",
//                                   ...; spaces as '_') to that peer → "carrier NAME"
//   exit
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/engine.h"
#include "tcp_gpu_common.h"

using namespace ferry;

namespace {

// cuMem* through the runtime's entry points: the test links no libcuda.
template <typename F>
F driver(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
  return reinterpret_cast<F>(p);
}

struct Buffer {
  std::string kind;
  size_t size = 0, off = 0, len = 0;
  uint8_t* base = nullptr;
  std::vector<uint8_t> host;  // kind "host"
  RegionId region = 0;
  // vmm
  CUdeviceptr va = 0;
  std::vector<CUmemGenericAllocationHandle> handles;
};

// Two physical allocations mapped back to back in one reservation (what
// PyTorch's expandable segments do), exportable as POSIX descriptors.
bool alloc_vmm(Buffer& b) {
  auto create = driver<CUresult (*)(CUmemGenericAllocationHandle*, size_t,
                                    const CUmemAllocationProp*, unsigned long long)>("cuMemCreate");
  auto reserve =
      driver<CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long)>(
          "cuMemAddressReserve");
  auto map = driver<CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                                 unsigned long long)>("cuMemMap");
  auto access =
      driver<CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t)>("cuMemSetAccess");
  auto granularity =
      driver<CUresult (*)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags)>(
          "cuMemGetAllocationGranularity");
  if (!create || !reserve || !map || !access || !granularity) return false;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = gputest::peer_device();  // the GPU this process uses
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t g = 0;
  if (granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) return false;
  const size_t half = (b.size / 2 + g - 1) / g * g;
  b.size = 2 * half;
  if (reserve(&b.va, b.size, 0, 0, 0) != CUDA_SUCCESS) return false;
  for (int i = 0; i < 2; ++i) {
    CUmemGenericAllocationHandle h;
    if (create(&h, half, &prop, 0) != CUDA_SUCCESS) return false;
    if (map(b.va + i * half, half, 0, h, 0) != CUDA_SUCCESS) return false;
    b.handles.push_back(h);
  }
  CUmemAccessDesc d{};
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = gputest::peer_device();
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (access(b.va, b.size, &d, 1) != CUDA_SUCCESS) return false;
  b.base = reinterpret_cast<uint8_t*>(b.va);
  return true;
}

void free_vmm(Buffer& b) {
  auto unmap = driver<CUresult (*)(CUdeviceptr, size_t)>("cuMemUnmap");
  auto release = driver<CUresult (*)(CUmemGenericAllocationHandle)>("cuMemRelease");
  auto address_free = driver<CUresult (*)(CUdeviceptr, size_t)>("cuMemAddressFree");
  unmap(b.va, b.size);
  for (auto h : b.handles) release(h);
  address_free(b.va, b.size);
  b.handles.clear();
}

bool allocate(Buffer& b) {
  if (b.kind == "malloc")
    return cudaMalloc(reinterpret_cast<void**>(&b.base), b.size) == cudaSuccess;
  if (b.kind == "pool") {
    return cudaMallocAsync(reinterpret_cast<void**>(&b.base), b.size, nullptr) == cudaSuccess &&
           cudaStreamSynchronize(nullptr) == cudaSuccess;
  }
  if (b.kind == "pinned")
    return cudaMallocHost(reinterpret_cast<void**>(&b.base), b.size) == cudaSuccess;
  if (b.kind == "vmm") return alloc_vmm(b);
  if (b.kind == "host") {
    b.host.resize(b.size);
    b.base = b.host.data();
    return true;
  }
  return false;
}

void release(Buffer& b) {
  if (b.kind == "malloc" || b.kind == "pool") cudaFree(b.base);
  if (b.kind == "pinned") cudaFreeHost(b.base);
  if (b.kind == "vmm") free_vmm(b);
  if (b.kind == "host") std::vector<uint8_t>().swap(b.host);
  b.base = nullptr;
}

bool is_device(const Buffer& b) {
  return b.kind == "malloc" || b.kind == "pool" || b.kind == "vmm";
}

}  // namespace

int main() {
  if (cudaSetDevice(gputest::peer_device()) != cudaSuccess) {
    std::printf("error no CUDA device %d\n", gputest::peer_device());
    return 1;
  }
  auto engine = Engine::create();
  if (!engine.ok()) {
    std::printf("error %s\n", engine.status().to_string().c_str());
    return 1;
  }
  Engine& e = *engine.value();
  std::printf("ready %s\n", gputest::hex(e.metadata()).c_str());
  std::fflush(stdout);
  std::map<std::string, Buffer> buffers;

  auto register_and_print = [&](Buffer& b) {
    auto r = e.register_memory(b.base + b.off, b.len);
    if (!r.ok()) {
      std::printf("error %s\n", r.status().to_string().c_str());
      return;
    }
    b.region = r->id;
    auto d = e.advertise(r->id);
    std::printf("desc %s %llx\n", gputest::hex(d.value().to_bytes()).c_str(),
                static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(b.base + b.off)));
  };

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd, name;
    in >> cmd >> name;
    if (cmd == "alloc") {
      Buffer b;
      in >> b.kind >> b.size;
      if (!(in >> b.off >> b.len)) {
        b.off = 0;
        b.len = 0;
      }
      if (!allocate(b)) {
        std::printf("error cannot allocate %s\n", b.kind.c_str());
      } else {
        if (b.len == 0) b.len = b.size - b.off;
        buffers[name] = std::move(b);
        register_and_print(buffers[name]);
      }
    } else if (cmd == "realloc") {
      Buffer& b = buffers[name];
      (void)e.deregister_memory(b.region);
      release(b);
      if (!allocate(b)) {
        std::printf("error cannot allocate %s again\n", b.kind.c_str());
      } else {
        register_and_print(b);
      }
    } else if (cmd == "fill") {
      uint64_t seed;
      in >> seed;
      Buffer& b = buffers[name];
      std::vector<uint8_t> image(b.len);
      gputest::fill(image.data(), b.len, seed);
      if (is_device(b)) {
        cudaMemcpy(b.base + b.off, image.data(), b.len, cudaMemcpyHostToDevice);
      } else {
        std::copy(image.begin(), image.end(), b.base + b.off);
      }
      std::printf("ok\n");
    } else if (cmd == "sum") {
      uint64_t off, len;
      in >> off >> len;
      Buffer& b = buffers[name];
      std::vector<uint8_t> copy(len);
      if (is_device(b)) {
        cudaMemcpy(copy.data(), b.base + b.off + off, len, cudaMemcpyDeviceToHost);
      } else {
        std::copy(b.base + b.off + off, b.base + b.off + off + len, copy.begin());
      }
      std::printf("sum %llu\n", static_cast<unsigned long long>(gputest::fnv(copy.data(), len)));
    } else if (cmd == "dereg") {
      const auto t0 = std::chrono::steady_clock::now();
      Status s = e.deregister_memory(buffers[name].region);
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - t0)
                          .count();
      if (s.ok()) {
        std::printf("ok %lld\n", static_cast<long long>(ms));
      } else {
        std::printf("error %s\n", s.to_string().c_str());
      }
    } else if (cmd == "notif") {
      auto n = e.wait_notifications(std::chrono::milliseconds(std::stoll(name)));
      if (n.empty()) {
        std::printf("none\n");
      } else {
        std::printf("notif %s\n", std::string(n[0].payload.begin(), n[0].payload.end()).c_str());
      }
    } else if (cmd == "listen") {
      std::printf("listen %s\n", e.listen_address().c_str());
    } else if (cmd == "carrier") {
      std::string route;
      in >> route;
      std::replace(route.begin(), route.end(), '_', ' ');
      auto info = e.peer_transports(std::stoull(name, nullptr, 16));
      std::string carrier = "none";
      if (info.ok()) {
        for (const auto& t : *info) {
          if (t.carries.find(route) != std::string::npos) carrier = t.transport;
        }
      }
      std::printf("carrier %s\n", carrier.c_str());
    } else if (cmd == "exit") {
      break;
    } else {
      std::printf("error unknown command %s\n", cmd.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}
