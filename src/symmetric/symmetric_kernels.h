// Launchers of the small kernels behind SymmetricMemory's host-posted
// operations (symmetric_ops.cu). CUDA C++17: no ferry/status.h here.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "ferry/device_team.h"

namespace ferry::symmetric {

// Copies `bytes` from local `src` to member `peer`'s data at `dst_offset` with
// `blocks` blocks of stores (each a contiguous share), every thread ending with
// quiet(): a signal posted after it on the stream is ordered after every byte.
cudaError_t launch_put(const DeviceTeam& team, int peer, uint64_t dst_offset, const void* src,
                       uint64_t bytes, int blocks, cudaStream_t stream);
cudaError_t launch_signal(const DeviceTeam& team, int peer, uint32_t slot, uint64_t value, bool add,
                          cudaStream_t stream);
cudaError_t launch_wait(const DeviceTeam& team, uint32_t slot, uint64_t at_least,
                        uint64_t timeout_ns, cudaStream_t stream);
// Every member sets its slot on every member to `epoch`, then waits for all
// members' slots to reach it (reserved slots [signal_slots, signal_slots + size)).
cudaError_t launch_barrier(const DeviceTeam& team, uint64_t epoch, cudaStream_t stream);
// Loads the kernels now (cudaFuncGetAttributes). With CUDA's lazy loading a
// kernel is loaded at its first launch, which may wait for the kernels
// running: a wait kernel spinning for a signal that kernel is to send would
// never end.
cudaError_t preload_kernels();

}  // namespace ferry::symmetric
