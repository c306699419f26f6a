// Memory-kind detection on a real GPU: cudaMalloc, stream-ordered pool,
// cuMem (VMM), managed, pinned (allocated and registered) and pageable host
// memory; allocation base and buffer id.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/cuda_detect.h"
#include "ferry/gpu.h"
#include "gpu_test_util.h"

namespace ferry {
namespace {

using ferry::testing::Buffer;
using ferry::testing::GpuTest;
using ferry::testing::Mem;

CudaPointerInfo info_of(const void* p) {
  Result<CudaPointerInfo> r = cuda_pointer_info(p);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? r.value() : CudaPointerInfo{};
}

TEST_F(GpuTest, DetectsCudaMalloc) {
  Buffer a(Mem::kDevice, 1 << 20), b(Mem::kDevice, 1 << 20);
  CudaPointerInfo i = info_of(a.data() + 12345);
  EXPECT_EQ(i.type, CudaMemoryType::kDevice);
  EXPECT_EQ(i.device, 0);
  EXPECT_EQ(i.base, reinterpret_cast<uint64_t>(a.data())) << "base of an interior pointer";
  EXPECT_GE(i.size, 1u << 20);
  EXPECT_NE(i.buffer_id, 0u);
  EXPECT_TRUE(i.ipc_capable);
  EXPECT_EQ(i.device_address, reinterpret_cast<uint64_t>(a.data() + 12345));
  EXPECT_NE(info_of(b.data()).buffer_id, i.buffer_id);
  MemoryKindInfo k = cuda_detect_memory_kind(a.data());
  EXPECT_EQ(k.kind, MemoryKind::kCuda);
  EXPECT_EQ(k.device, 0);
}

TEST_F(GpuTest, DetectsHostMemory) {
  Buffer pinned(Mem::kPinned, 1 << 16), reg(Mem::kRegistered, 1 << 16),
      pageable(Mem::kPageable, 1 << 16);
  CudaPointerInfo p = info_of(pinned.data() + 100);
  EXPECT_EQ(p.type, CudaMemoryType::kPinnedHost);
  EXPECT_EQ(p.base, reinterpret_cast<uint64_t>(pinned.data()));
  EXPECT_NE(p.device_address, 0u) << "pinned memory is mapped for kernels";
  EXPECT_EQ(info_of(reg.data()).type, CudaMemoryType::kPinnedHost);
  EXPECT_EQ(info_of(pageable.data()).type, CudaMemoryType::kPageableHost);
  int on_stack = 0;
  EXPECT_EQ(info_of(&on_stack).type, CudaMemoryType::kPageableHost);
  for (void* h : {static_cast<void*>(pinned.data()), static_cast<void*>(reg.data()),
                  static_cast<void*>(pageable.data())}) {
    MemoryKindInfo k = cuda_detect_memory_kind(h);
    EXPECT_EQ(k.kind, MemoryKind::kHost);
    EXPECT_EQ(k.device, -1);
  }
}

TEST_F(GpuTest, DetectsManagedAndPoolMemory) {
  Buffer m(Mem::kManaged, 1 << 16);
  CudaPointerInfo i = info_of(m.data());
  EXPECT_EQ(i.type, CudaMemoryType::kManaged);
  EXPECT_EQ(cuda_detect_memory_kind(m.data()).kind, MemoryKind::kCuda);

  void* p = nullptr;
  FERRY_CUDA_OK(cudaMallocAsync(&p, 1 << 20, nullptr));
  FERRY_CUDA_OK(cudaStreamSynchronize(nullptr));
  EXPECT_EQ(info_of(p).type, CudaMemoryType::kDevicePool);
  EXPECT_EQ(cuda_detect_memory_kind(p).kind, MemoryKind::kCuda);
  FERRY_CUDA_OK(cudaFreeAsync(p, nullptr));
  FERRY_CUDA_OK(cudaStreamSynchronize(nullptr));
}

// cuMem* reached through the runtime's entry-point lookup (no libcuda link).
template <typename F>
F driver_fn(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<F>(p);
}

TEST_F(GpuTest, DetectsVmmMemoryAndCopiesThroughIt) {
  auto granularity =
      driver_fn<CUresult (*)(size_t*, const CUmemAllocationProp*,
                             CUmemAllocationGranularity_flags)>("cuMemGetAllocationGranularity");
  auto create =
      driver_fn<CUresult (*)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                             unsigned long long)>("cuMemCreate");
  auto reserve =
      driver_fn<CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long)>(
          "cuMemAddressReserve");
  auto map = driver_fn<CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                                    unsigned long long)>("cuMemMap");
  auto set_access = driver_fn<CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t)>(
      "cuMemSetAccess");
  auto unmap = driver_fn<CUresult (*)(CUdeviceptr, size_t)>("cuMemUnmap");
  auto release = driver_fn<CUresult (*)(CUmemGenericAllocationHandle)>("cuMemRelease");
  auto free_va = driver_fn<CUresult (*)(CUdeviceptr, size_t)>("cuMemAddressFree");
  if (!granularity || !create || !reserve || !map || !set_access || !unmap || !release ||
      !free_va) {
    GTEST_SKIP() << "skipped: driver lacks the cuMem entry points";
  }
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t g = 0;
  ASSERT_EQ(granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_SUCCESS);
  const size_t n = g;
  CUmemGenericAllocationHandle h{};
  ASSERT_EQ(create(&h, n, &prop, 0), CUDA_SUCCESS);
  CUdeviceptr va = 0;
  ASSERT_EQ(reserve(&va, n, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(map(va, n, 0, h, 0), CUDA_SUCCESS);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(set_access(va, n, &access, 1), CUDA_SUCCESS);

  auto* p = reinterpret_cast<uint8_t*>(va);
  CudaPointerInfo i = info_of(p + 64);
  EXPECT_EQ(i.type, CudaMemoryType::kDeviceVmm) << cuda_memory_type_name(i.type);
  EXPECT_EQ(i.device, 0);
  EXPECT_EQ(i.base, va);
  EXPECT_EQ(cuda_detect_memory_kind(p).kind, MemoryKind::kCuda);

  // The kernel path reads and writes VMM memory like any device memory.
  Buffer host(Mem::kPinned, 8192);
  for (int k = 0; k < 8192; ++k) host.data()[k] = static_cast<uint8_t>(k * 7);
  std::vector<CopyBlock> blocks = {{p + 1, host.data() + 3, 4000},
                                   {host.data() + 4096, p + 1, 4000}};
  ASSERT_TRUE(copy_blocks({blocks.data(), 1}).ok());
  Status s = copy_blocks({blocks.data() + 1, 1});
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (int k = 0; k < 4000; ++k)
    ASSERT_EQ(host.data()[4096 + k], static_cast<uint8_t>((k + 3) * 7));

  EXPECT_EQ(unmap(va, n), CUDA_SUCCESS);
  EXPECT_EQ(release(h), CUDA_SUCCESS);
  EXPECT_EQ(free_va(va, n), CUDA_SUCCESS);
}

// Every visible GPU named by what it is: distinct UUIDs and PCI bus ids that
// lead back to its ordinal, in every spelling; GPU memory's kind carries its
// GPU's PCI bus id (descriptors name the GPU by it).
TEST_F(GpuTest, GpusAreNamedByUuidAndPciBusId) {
  auto gpus = gpu_identities();
  ASSERT_TRUE(gpus.ok()) << gpus.status().to_string();
  ASSERT_EQ(static_cast<int>(gpus->size()), cuda_device_count());
  auto ordinal = [](const std::string& name) {
    Result<int> r = gpu_ordinal(name);
    EXPECT_TRUE(r.ok()) << name << ": " << r.status().to_string();
    return r.ok() ? *r : -1;
  };
  for (const GpuIdentity& g : *gpus) {
    SCOPED_TRACE(g.uuid + " " + g.pci_bus_id);
    EXPECT_EQ(g.uuid.rfind("GPU-", 0), 0u);
    EXPECT_EQ(g.uuid.size(), 40u);
    ASSERT_EQ(g.pci_bus_id.size(), 12u);  // 0000:18:00.0
    EXPECT_EQ(ordinal(g.uuid), g.ordinal);
    EXPECT_EQ(ordinal(g.pci_bus_id), g.ordinal);
    std::string upper = g.pci_bus_id;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    EXPECT_EQ(ordinal("0000" + upper), g.ordinal) << "nvidia-smi's 8-digit domain";
    EXPECT_EQ(pci_bus_id_text(cuda_device_pci(g.ordinal)), g.pci_bus_id);
    for (const GpuIdentity& o : *gpus) {
      if (o.ordinal != g.ordinal) {
        EXPECT_NE(o.uuid, g.uuid);
        EXPECT_NE(o.pci_bus_id, g.pci_bus_id);
      }
    }
  }
  auto none = gpu_ordinal("ffff:ff:1f.7");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find((*gpus)[0].pci_bus_id), std::string::npos)
      << "the answer names what this process sees: " << none.status().message();
  Buffer a(Mem::kDevice, 1 << 20);
  EXPECT_EQ(pci_bus_id_text(cuda_detect_memory_kind(a.data()).gpu_pci), (*gpus)[0].pci_bus_id);
}

TEST_F(GpuTest, CudaAvailableAndCount) {
  std::string reason = "unchanged";
  EXPECT_TRUE(cuda_available(&reason));
  EXPECT_TRUE(reason.empty());
  EXPECT_GE(cuda_device_count(), 1);
}

}  // namespace
}  // namespace ferry
