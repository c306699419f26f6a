// engine.gpu_same_host_path: how GPU memory moves between two engines of one
// host. auto takes the best path that works for the pair (cuda_ipc, where the
// driver maps the peer's memory; else shm staging through shared pinned host
// memory; else tcp); the other values force one path, so that each is tested
// and can be chosen on purpose.
//
// Policy, in core: TransportSet asks allows() per transport and route, and
// shm reads the setting to know whether to keep GPU staging areas.
#pragma once

#include <string>
#include <string_view>

#include "ferry/status.h"

namespace ferry {

enum class GpuSameHostPath { kAuto, kCudaIpc, kShmStaged, kTcp };

inline constexpr const char* kGpuSameHostPathOption = "engine.gpu_same_host_path";

// "auto", "cuda_ipc", "shm_staged" or "tcp"; anything else is InvalidArgument
// naming the option, the value and the choices.
Result<GpuSameHostPath> parse_gpu_same_host_path(std::string_view text);
std::string_view gpu_same_host_path_name(GpuSameHostPath path);

// Whether `transport` may carry GPU memory under `path`: a same-host
// transport only when the path is auto or names it (cuda_ipc; shm for
// shm_staged); a network transport always (it carries what no same-host
// path is allowed to).
bool gpu_path_allows(GpuSameHostPath path, std::string_view transport, bool same_host_only);

// Whether shm should stage GPU memory at all under `path`.
inline bool shm_stages_gpu(GpuSameHostPath path) {
  return path == GpuSameHostPath::kAuto || path == GpuSameHostPath::kShmStaged;
}

}  // namespace ferry
