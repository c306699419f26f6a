// The SM gather/scatter kernel: copies many small blocks in one launch, each
// warp moving whole blocks with 16-byte accesses (narrower ones when source
// and destination differ in alignment). Pointers must be device-accessible:
// device memory, managed memory, or mapped pinned host memory by its device
// address.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ferry::cuda {

// One block as the kernel sees it (24 bytes, read once per warp).
struct CopyDesc {
  uint64_t dst;
  uint64_t src;
  uint64_t size;
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
                          uint32_t max_ctas, uint32_t* sm_mask, cudaStream_t stream,
                          uint32_t* ctas);

}  // namespace ferry::cuda
