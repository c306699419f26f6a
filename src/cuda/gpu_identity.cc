// The GPUs this process sees, named by what they are (UUID, PCI bus id).
#include <cuda_runtime_api.h>

#include "cuda/cuda_detect.h"
#include "cuda/cuda_util.h"
#include "ferry/gpu.h"
#include "fmt/format.h"

namespace ferry {
namespace {
std::vector<uint32_t>& pci_of_ordinal() {
  static std::vector<uint32_t> v;  // filled once, with gpu_identities()' list
  return v;
}
}  // namespace

Result<std::vector<GpuIdentity>> gpu_identities() {
  // Asked once: the visible set of a process does not change.
  static const Result<std::vector<GpuIdentity>> gpus = []() -> Result<std::vector<GpuIdentity>> {
    std::string reason;
    if (!cuda_available(&reason)) return err::NotSupported(reason);
    std::vector<GpuIdentity> out;
    for (int i = 0; i < cuda_device_count(); ++i) {
      cudaDeviceProp prop{};
      if (cudaError_t e = cudaGetDeviceProperties(&prop, i); e != cudaSuccess) {
        cudaGetLastError();
        return cuda::cuda_status(e, "cudaGetDeviceProperties");
      }
      const auto* u = reinterpret_cast<const uint8_t*>(prop.uuid.bytes);
      GpuIdentity g;
      g.ordinal = i;
      g.uuid = fmt::format(
          "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-"
          "{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
          u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
          u[14], u[15]);
      // GPUs are PCI function 0 (cudaDeviceProp has no function number).
      g.pci_bus_id = pci_bus_id_text(pack_pci_bus_id(static_cast<uint32_t>(prop.pciDomainID),
                                                     static_cast<uint32_t>(prop.pciBusID),
                                                     static_cast<uint32_t>(prop.pciDeviceID), 0));
      g.name = prop.name;
      out.push_back(std::move(g));
      pci_of_ordinal().push_back(pack_pci_bus_id(static_cast<uint32_t>(prop.pciDomainID),
                                                 static_cast<uint32_t>(prop.pciBusID),
                                                 static_cast<uint32_t>(prop.pciDeviceID), 0));
    }
    return out;
  }();
  return gpus;
}

}  // namespace ferry

namespace ferry {
uint32_t cuda_device_pci(int ordinal) {
  if (!gpu_identities().ok() || ordinal < 0 ||
      static_cast<size_t>(ordinal) >= pci_of_ordinal().size()) {
    return 0;
  }
  return pci_of_ordinal()[static_cast<size_t>(ordinal)];
}
}  // namespace ferry
