// The SM gather/scatter kernel: copies many small blocks in one launch, each
// warp moving whole blocks with 16-byte accesses (narrower ones when source
// and destination differ in alignment). Pointers must be device-accessible:
// device memory, managed memory, or mapped pinned host memory by its device
// address.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ferry::cuda {

// One block as the kernel sees it (24 bytes, read once per warp). The top
// bit of `size` says the source is host memory (see HostLoad).
struct CopyDesc {
  uint64_t dst;
  uint64_t src;
  uint64_t size;
};
constexpr uint64_t kSrcIsHost = 1ull << 63;

// How the kernel loads from host (system) memory. Default ld.global.cv: PTX
// treats any L2 copy of a system-memory line as stale and fetches again, a
// defensive choice for buffers the CPU rewrites between copies (CUDA already
// orders host writes before a launch); it measured no slower than .cs on an
// H100 (docs/gpu.md). The others stay selectable for measurement.
enum class HostLoad : uint8_t {
  kFetchAgain = 0,  // ld.global.cv
  kStreaming,       // ld.global.cs
  kPrefetch256,     // ld.global.L2::256B (asks L2 for 256-byte fetches)
};
struct GatherConfig {
  HostLoad host_load = HostLoad::kFetchAgain;
};

// Up to this many descriptors travel in the launch's parameter block, which
// saves a round trip to host memory for small batches.
constexpr uint32_t kInlineDescs = 120;

// Threads per CTA: 32 warps, each with a 4 KiB round of loads in flight.
constexpr uint32_t kGatherThreads = 1024;

// Launches one kernel over `count` descriptors with at most `max_ctas` CTAs.
// `dev_descs` is the device address of the descriptors (mapped pinned host
// memory); batches of at most kInlineDescs are instead copied from
// `host_descs` into the launch parameters. When `sm_mask` (8 words of device
// memory) is set each CTA ORs in the id of the SM it runs on. *ctas receives
// the grid size.
cudaError_t launch_gather(const CopyDesc* host_descs, const CopyDesc* dev_descs, uint32_t count,
                          uint32_t max_ctas, GatherConfig config, uint32_t* sm_mask,
                          cudaStream_t stream, uint32_t* ctas);

}  // namespace ferry::cuda
