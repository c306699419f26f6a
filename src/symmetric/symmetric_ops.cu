// The host-posted operations of SymmetricMemory as one-block kernels built on
// the device API itself, so host and device calls have the same semantics.
#include "ferry/device.cuh"
#include "symmetric/moe_kernels.h"
#include "symmetric/put_share.h"
#include "symmetric/symmetric_kernels.h"

namespace ferry::symmetric {
namespace {

__global__ void put_kernel(DeviceTeam team, int peer, uint64_t dst_offset, const uint8_t* src,
                           uint64_t bytes) {
  uint64_t first = 0, n = 0;
  put_share(bytes, gridDim.x, blockIdx.x, &first, &n);
  if (n > 0) device::put_block(team, peer, dst_offset + first, src + first, n);
  device::quiet();
}

__global__ void signal_kernel(DeviceTeam team, int peer, uint32_t slot, uint64_t value, bool add) {
  // Earlier work on the stream finished before this kernel started; the fence
  // makes its writes (copy-engine puts included) visible before the signal.
  device::fence();
  device::signal(team, peer, slot, value, add ? device::SignalOp::kAdd : device::SignalOp::kSet);
}

__global__ void wait_kernel(DeviceTeam team, uint32_t slot, uint64_t at_least,
                            uint64_t timeout_ns) {
  device::wait(team, slot, at_least, timeout_ns);
}

__global__ void barrier_kernel(DeviceTeam team, uint64_t epoch) {
  const int r = static_cast<int>(threadIdx.x);
  const uint32_t base = team.signal_slots;
  if (r < team.size) {
    device::quiet();
    device::signal(team, r, base + static_cast<uint32_t>(team.rank), epoch);
  }
  __syncthreads();
  if (r < team.size) device::wait(team, base + static_cast<uint32_t>(r), epoch);
  __syncthreads();
}

}  // namespace

cudaError_t launch_put(const DeviceTeam& team, int peer, uint64_t dst_offset, const void* src,
                       uint64_t bytes, int blocks, cudaStream_t stream) {
  put_kernel<<<blocks, 512, 0, stream>>>(team, peer, dst_offset, static_cast<const uint8_t*>(src),
                                         bytes);
  return cudaGetLastError();
}

cudaError_t launch_signal(const DeviceTeam& team, int peer, uint32_t slot, uint64_t value, bool add,
                          cudaStream_t stream) {
  signal_kernel<<<1, 1, 0, stream>>>(team, peer, slot, value, add);
  return cudaGetLastError();
}

cudaError_t launch_wait(const DeviceTeam& team, uint32_t slot, uint64_t at_least,
                        uint64_t timeout_ns, cudaStream_t stream) {
  wait_kernel<<<1, 1, 0, stream>>>(team, slot, at_least, timeout_ns);
  return cudaGetLastError();
}

cudaError_t preload_kernels() {
  cudaFuncAttributes attr;
  for (const void* k :
       {reinterpret_cast<const void*>(&put_kernel), reinterpret_cast<const void*>(&signal_kernel),
        reinterpret_cast<const void*>(&wait_kernel),
        reinterpret_cast<const void*>(&barrier_kernel)}) {
    if (cudaError_t e = cudaFuncGetAttributes(&attr, k); e != cudaSuccess) return e;
  }
  return preload_moe_kernels();
}

cudaError_t launch_barrier(const DeviceTeam& team, uint64_t epoch, cudaStream_t stream) {
  const int threads = ((team.size + 31) / 32) * 32;
  barrier_kernel<<<1, threads, 0, stream>>>(team, epoch);
  return cudaGetLastError();
}

}  // namespace ferry::symmetric
