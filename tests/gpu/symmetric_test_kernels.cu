// Kernels of symmetric_test.cc; see symmetric_test_kernels.h.
#include "ferry/device.cuh"
#include "symmetric_test_kernels.h"

namespace symtest {
namespace dev = ferry::device;
namespace {

__global__ void put_three_ways_kernel(ferry::DeviceTeam team, int peer, const uint8_t* src,
                                      uint64_t tb, uint64_t wb, uint64_t bb) {
  if (threadIdx.x == 0) {
    dev::put_thread(team, peer, 0, src, tb);
    dev::signal(team, peer, 0, 1, dev::SignalOp::kAdd);
  }
  const uint64_t wo = (tb + 15) / 16 * 16;  // the warp and block puts are 16-byte aligned
  if (threadIdx.x < 32) {
    dev::put_warp(team, peer, wo, src + wo, wb);
    dev::signal_warp(team, peer, 1, 1, dev::SignalOp::kAdd);
  }
  dev::put_block(team, peer, wo + wb, src + wo + wb, bb);
  dev::signal_block(team, peer, 2, 1, dev::SignalOp::kAdd);
}

__global__ void wait_three_kernel(ferry::DeviceTeam team, int* ok) {
  int good = 1;
  for (uint32_t s = 0; s < 3; ++s) good &= dev::wait(team, s, 1) ? 1 : 0;
  *ok = good;
}

__global__ void ordered_send_kernel(ferry::DeviceTeam team, int peer, const uint8_t* src,
                                    uint64_t region_bytes, int regions, uint32_t first_slot) {
  for (int i = static_cast<int>(blockIdx.x); i < regions; i += static_cast<int>(gridDim.x)) {
    const uint64_t off = static_cast<uint64_t>(i) * region_bytes;
    dev::put_block(team, peer, off, src + off, region_bytes);
    dev::signal_block(team, peer, first_slot + blockIdx.x, static_cast<uint64_t>(i) + 1);
  }
}

__global__ void ordered_check_kernel(ferry::DeviceTeam team, const uint8_t* expected,
                                     uint64_t region_bytes, int regions, uint32_t first_slot,
                                     unsigned long long* mismatches, int* timeouts) {
  __shared__ int ok;
  const uint8_t* data = team.data[team.rank];
  for (int i = static_cast<int>(blockIdx.x); i < regions; i += static_cast<int>(gridDim.x)) {
    if (threadIdx.x == 0) {
      ok = dev::wait(team, first_slot + blockIdx.x, static_cast<uint64_t>(i) + 1) ? 1 : 0;
      if (!ok) atomicAdd(timeouts, 1);
    }
    __syncthreads();
    if (ok) {
      const uint64_t off = static_cast<uint64_t>(i) * region_bytes;
      unsigned long long bad = 0;
      // Plain (weak) loads after the acquire: what a user's kernel would do.
      for (uint64_t b = threadIdx.x; b < region_bytes; b += blockDim.x) {
        bad += data[off + b] != expected[off + b] ? 1 : 0;
      }
      if (bad != 0) atomicAdd(mismatches, bad);
    }
    __syncthreads();
  }
}

__global__ void signal_storm_kernel(ferry::DeviceTeam team, int peer, uint32_t slots,
                                    uint32_t set_slot) {
  const uint32_t g = blockIdx.x * blockDim.x + threadIdx.x;
  dev::signal(team, peer, g % slots, 1, dev::SignalOp::kAdd);
  dev::signal(team, peer, set_slot, g + 1, dev::SignalOp::kSet);
}

__global__ void wait_one_kernel(ferry::DeviceTeam team, uint32_t slot, uint64_t at_least,
                                uint64_t timeout_ns, int* result, uint64_t* observed) {
  *result = dev::wait(team, slot, at_least, timeout_ns, observed) ? 1 : 0;
}

__global__ void bad_call_kernel(ferry::DeviceTeam team, int which, int* result) {
  uint8_t byte = 0;
  bool ok = true;
  if (which == 0) ok = dev::put_thread(team, team.size, 0, &byte, 1);
  if (which == 1) ok = dev::signal(team, 0, team.signal_slots + team.reserved_slots, 1);
  if (which == 2) ok = dev::put_thread(team, 0, team.data_bytes, &byte, 1);
  *result = ok ? 0 : 1;
}

}  // namespace

cudaError_t put_three_ways(const ferry::DeviceTeam& team, int peer, const uint8_t* src, uint64_t tb,
                           uint64_t wb, uint64_t bb, cudaStream_t stream) {
  put_three_ways_kernel<<<1, 256, 0, stream>>>(team, peer, src, tb, wb, bb);
  return cudaGetLastError();
}
cudaError_t wait_three(const ferry::DeviceTeam& team, int* ok, cudaStream_t stream) {
  wait_three_kernel<<<1, 1, 0, stream>>>(team, ok);
  return cudaGetLastError();
}
cudaError_t ordered_send(const ferry::DeviceTeam& team, int peer, const uint8_t* src,
                         uint64_t region_bytes, int regions, int blocks, uint32_t first_slot,
                         cudaStream_t stream) {
  ordered_send_kernel<<<blocks, 256, 0, stream>>>(team, peer, src, region_bytes, regions,
                                                  first_slot);
  return cudaGetLastError();
}
cudaError_t ordered_check(const ferry::DeviceTeam& team, const uint8_t* expected,
                          uint64_t region_bytes, int regions, int blocks, uint32_t first_slot,
                          unsigned long long* mismatches, int* timeouts, cudaStream_t stream) {
  ordered_check_kernel<<<blocks, 256, 0, stream>>>(team, expected, region_bytes, regions,
                                                   first_slot, mismatches, timeouts);
  return cudaGetLastError();
}
cudaError_t signal_storm(const ferry::DeviceTeam& team, int peer, uint32_t slots, uint32_t set_slot,
                         int blocks, int threads, cudaStream_t stream) {
  signal_storm_kernel<<<blocks, threads, 0, stream>>>(team, peer, slots, set_slot);
  return cudaGetLastError();
}
cudaError_t wait_one(const ferry::DeviceTeam& team, uint32_t slot, uint64_t at_least,
                     uint64_t timeout_ns, int* result, uint64_t* observed, cudaStream_t stream) {
  wait_one_kernel<<<1, 1, 0, stream>>>(team, slot, at_least, timeout_ns, result, observed);
  return cudaGetLastError();
}
cudaError_t preload() {
  cudaFuncAttributes a;
  const void* kernels[] = {reinterpret_cast<const void*>(&put_three_ways_kernel),
                           reinterpret_cast<const void*>(&wait_three_kernel),
                           reinterpret_cast<const void*>(&ordered_send_kernel),
                           reinterpret_cast<const void*>(&ordered_check_kernel),
                           reinterpret_cast<const void*>(&signal_storm_kernel),
                           reinterpret_cast<const void*>(&wait_one_kernel),
                           reinterpret_cast<const void*>(&bad_call_kernel)};
  for (const void* k : kernels) {
    if (cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t bad_call(const ferry::DeviceTeam& team, int which, int* result, cudaStream_t stream) {
  bad_call_kernel<<<1, 1, 0, stream>>>(team, which, result);
  return cudaGetLastError();
}

}  // namespace symtest
