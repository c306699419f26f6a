// The resident copy kernel: one CTA that stays on the GPU between small
// copies and takes each from a doorbell in mapped host memory, so that a
// small copy costs neither a launch nor a driver call (cudaMemcpyAsync costs
// ~5 us of host time on an H200 host, a launch ~4.6 us; bench/cuda_ipc/
// latency_floor.cu). ResidentCopier (resident_copier.h) is its host side.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ferry::cuda {

// One posted copy as the host writes it: three 16-byte halves, each carrying
// the copy's ticket. The host stores each half with one 16-byte store and the
// kernel loads it with one, so a kernel that sees the ticket in all three
// sees one posting's values, without a second round trip over PCIe to read
// the fields after a flag.
struct alignas(64) ResidentSlot {
  uint64_t dst, dst_ticket;
  uint64_t src, src_ticket;
  uint64_t size_flags, size_ticket;  // size | kResidentWaitGate | kResidentDecide
  uint64_t pad[2];
};
// The copy waits until the gate (written by the legacy default stream, see
// ResidentCopier) has reached its ticket.
constexpr uint64_t kResidentWaitGate = 1ull << 63;
// Whether the copy waits for the gate is not known yet: the host posts the
// slot first and asks the legacy stream while the kernel takes it, then writes
// the answer into the slot's decision word (ticket << 2 | kResidentOpen or
// kResidentGated). The kernel defers the copy if no answer comes in gate_wait.
constexpr uint64_t kResidentDecide = 1ull << 62;
constexpr uint64_t kResidentFlags = kResidentWaitGate | kResidentDecide;
constexpr uint64_t kResidentOpen = 1;
constexpr uint64_t kResidentGated = 2;
constexpr uint32_t kResidentSlots = 64;
constexpr uint32_t kResidentThreads = 512;
constexpr uint32_t kResidentUnroll = 8;  // 16-byte loads in flight per thread
// Per-slot status, written by the kernel: ticket << 2 | state.
constexpr uint64_t kResidentDone = 1;
constexpr uint64_t kResidentDeferred = 2;  // its gate did not open in time: not copied
// The exit word: epoch << kResidentEpochShift | the ticket the kernel would
// have taken next.
constexpr uint32_t kResidentEpochShift = 40;
constexpr uint64_t kResidentTicketMask = (1ull << kResidentEpochShift) - 1;

// Mapped, page-locked host memory shared by the host and the kernel.
struct ResidentShared {
  ResidentSlot slots[kResidentSlots];
  uint64_t status[kResidentSlots];
  uint64_t decision[kResidentSlots];  // written by the host for kResidentDecide slots
  uint64_t exit_word;
  uint64_t quit;  // non-zero: leave now
};

struct ResidentLaunch {
  ResidentShared* shared = nullptr;  // its device address
  const uint64_t* gate = nullptr;    // device memory
  uint64_t first_ticket = 1;
  uint64_t epoch = 0;         // this launch, echoed in the exit word
  uint64_t linger_ns = 0;     // leave after this long without a posting
  uint64_t gate_wait_ns = 0;  // defer a copy whose gate stays shut this long
};

// Launches the kernel (one CTA of kResidentThreads) on `stream`.
cudaError_t launch_resident_copier(const ResidentLaunch& launch, cudaStream_t stream);

}  // namespace ferry::cuda
