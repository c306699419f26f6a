// The copy stream's diagnostic knobs: environment variables read once when a
// stream is created, for measurement and for working around a platform. Each
// has a default that the product uses; a malformed value is an error naming
// the variable, never silently ignored.
#pragma once

#include <cstdint>

#include "cuda/gather_kernel.h"
#include "ferry/status.h"

namespace ferry::cuda {

// Launch schedule of a large batch: the first slice has kFirstSlice
// descriptors, each next one kSliceGrowth times more, up to kMaxSlice. The
// host classifies a block in ~25 ns; the GPU copies a 4 KiB block over PCIe
// in ~75 ns. While the GPU runs slice k the host must classify slice k+1, so
// growth must stay below ~3: with 4x (the old schedule, from 1024) the GPU
// idled ~150 us of a 5 ms copy waiting for slices 2 and 3. 2x keeps the GPU
// fed from the first slice on; a small first slice starts it after ~6 us.
constexpr uint32_t kFirstSlice = 256;
constexpr uint32_t kSliceGrowth = 2;
constexpr uint32_t kMaxSlice = 1u << 15;

// Diagnostic knobs, read when a stream is created (docs/gpu.md):
//   FERRY_GATHER_HOST_LOAD = cv | cs | pf256   how the kernel reads host memory
//   FERRY_GATHER_CE_EVERY  = n                 every n-th kernel block to the copy engine
//   FERRY_GATHER_SLICES    = first,growth,max  launch schedule of a large batch
//   FERRY_COPY_AFTER_DEFAULT = blocking | query | event  how after_default_stream
//       is kept: a blocking stream; a query of the legacy stream per submission
//       (an event only when it is busy); an event recorded there per submission
//   FERRY_RESIDENT_GATE = query | always        whether the resident kernel's
//       default-stream gate is skipped when that stream is idle (query, default)
enum class AfterDefault : uint8_t { kBlocking, kQuery, kEvent };
struct Knobs {
  GatherConfig gather;
  uint32_t ce_every = 0;
  uint32_t first_slice = kFirstSlice;
  uint32_t slice_growth = kSliceGrowth;
  uint32_t max_slice = kMaxSlice;
  AfterDefault after_default = AfterDefault::kBlocking;
  // FERRY_RESIDENT_GATE=always: the resident kernel waits on its gate even
  // when the legacy stream is idle (to measure the gate's cost).
  bool resident_gate_always = false;
};

Result<Knobs> read_knobs();

}  // namespace ferry::cuda
