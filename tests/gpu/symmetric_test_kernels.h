// Kernels of symmetric_test.cc (symmetric_test_kernels.cu): each exercises
// one part of include/ferry/device.cuh from inside a kernel.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "ferry/device_team.h"

namespace symtest {

// One thread puts `thread_bytes` from src to peer at offset 0 (any size: the
// caller passes an odd one), a warp puts `warp_bytes` at the next 16-byte
// boundary, a block `block_bytes` right after; each followed by its signal
// (slots 0, 1, 2: add 1). Source and destination offsets are equal.
cudaError_t put_three_ways(const ferry::DeviceTeam& team, int peer, const uint8_t* src,
                           uint64_t thread_bytes, uint64_t warp_bytes, uint64_t block_bytes,
                           cudaStream_t stream);
// Waits for slots 0..2 to reach 1 (false into *ok on a timeout).
cudaError_t wait_three(const ferry::DeviceTeam& team, int* ok, cudaStream_t stream);

// `blocks` blocks; block b sends regions i = b, b + blocks, ... < regions of
// region_bytes from src (put_block) to peer's data at i * region_bytes and
// after each sets peer's slot `first_slot + b` to i + 1.
cudaError_t ordered_send(const ferry::DeviceTeam& team, int peer, const uint8_t* src,
                         uint64_t region_bytes, int regions, int blocks, uint32_t first_slot,
                         cudaStream_t stream);
// The receiving side: after each signal, compares region i of this member's
// data with `expected`; counts differing bytes into *mismatches and regions
// whose wait failed into *timeouts.
cudaError_t ordered_check(const ferry::DeviceTeam& team, const uint8_t* expected,
                          uint64_t region_bytes, int regions, int blocks, uint32_t first_slot,
                          unsigned long long* mismatches, int* timeouts, cudaStream_t stream);

// blocks x threads threads each add 1 to peer's slot (thread index % slots),
// and set slot `set_slot` to their global index + 1 (release).
cudaError_t signal_storm(const ferry::DeviceTeam& team, int peer, uint32_t slots, uint32_t set_slot,
                         int blocks, int threads, cudaStream_t stream);

// One thread: wait(slot, at_least, timeout_ns) -> *result (1 ok, 0 timed out),
// *observed the slot's value.
cudaError_t wait_one(const ferry::DeviceTeam& team, uint32_t slot, uint64_t at_least,
                     uint64_t timeout_ns, int* result, uint64_t* observed, cudaStream_t stream);

// One thread makes a call with a bad argument: 0 put to member `size`,
// 1 signal on slot signal_slots + reserved_slots, 2 put past the data area.
// *result: 1 if the call said false (as it must).
// Loads every kernel above now: with CUDA's lazy loading, the first launch of
// a kernel may wait for running kernels -- a deadlock when those spin for it.
cudaError_t preload();

cudaError_t bad_call(const ferry::DeviceTeam& team, int which, int* result, cudaStream_t stream);

}  // namespace symtest
