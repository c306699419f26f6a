#include "core/gpu_path.h"

#include "fmt/format.h"

namespace ferry {

Result<GpuSameHostPath> parse_gpu_same_host_path(std::string_view text) {
  if (text == "auto") return GpuSameHostPath::kAuto;
  if (text == "cuda_ipc") return GpuSameHostPath::kCudaIpc;
  if (text == "shm_staged") return GpuSameHostPath::kShmStaged;
  if (text == "tcp") return GpuSameHostPath::kTcp;
  return err::InvalidArgument(fmt::format(
      "option {}: '{}' is none of auto, cuda_ipc, shm_staged, tcp", kGpuSameHostPathOption, text));
}

std::string_view gpu_same_host_path_name(GpuSameHostPath path) {
  switch (path) {
    case GpuSameHostPath::kAuto:
      return "auto";
    case GpuSameHostPath::kCudaIpc:
      return "cuda_ipc";
    case GpuSameHostPath::kShmStaged:
      return "shm_staged";
    case GpuSameHostPath::kTcp:
      return "tcp";
  }
  return "?";
}

bool gpu_path_allows(GpuSameHostPath path, std::string_view transport, bool same_host_only) {
  if (!same_host_only) return true;
  switch (path) {
    case GpuSameHostPath::kAuto:
      return true;
    case GpuSameHostPath::kCudaIpc:
      return transport == "cuda_ipc";
    case GpuSameHostPath::kShmStaged:
      return transport == "shm";
    case GpuSameHostPath::kTcp:
      return false;
  }
  return false;
}

}  // namespace ferry
