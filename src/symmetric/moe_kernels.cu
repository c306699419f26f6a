// MoE dispatch and combine as single kernels over the device API.
//
// Both kernels have the same three steps, so that no grid-wide barrier is
// needed and every byte moves by plain NVLink stores:
//  1. send: warps take work items (dispatch: one (token, k); combine: one
//     returned row) and copy a row with 16-byte stores straight into the
//     destination member's buffer;
//  2. count: a block adds 1 to blocks_done when all its sends are out (after a
//     __syncthreads and a fence); designated warps wait for every block, then
//     signal each destination (release, system scope) -- the signal is ordered
//     after every row the kernel sent;
//  3. receive: designated warps (dispatch) or the reducing warps (combine) wait
//     for the peers' signals with acquire loads, then read what they ordered.
// The grid never exceeds one block per SM (512 threads), so every block is
// resident and the waits in step 2 cannot starve a block that has not started.
#include <cuda_bf16.h>

#include "ferry/device.cuh"
#include "symmetric/moe_kernels.h"

namespace ferry::symmetric {
namespace {

constexpr int kWarpsPerBlock = kMoeThreadsPerBlock / 32;

__device__ __forceinline__ unsigned long long load_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Step 2's first half: this block's sends are out; returns once all blocks' are
// (lane 0 of the calling warp waits). False after the team's timeout.
__device__ __forceinline__ void block_sends_done(const MoeKernelArgs& a) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(a.blocks_done, 1ull);
  }
}

__device__ bool wait_all_blocks(const MoeKernelArgs& a) {
  if (load_acquire_gpu(a.blocks_done) >= a.blocks_done_target) return true;
  const uint64_t start = device::globaltimer_ns();
  for (uint32_t spins = 0;; ++spins) {
    const unsigned long long v = load_acquire_gpu(a.blocks_done);
    if (v >= a.blocks_done_target) return true;
    if ((spins & 63u) == 63u && device::globaltimer_ns() - start > a.team.timeout_ns) {
      // slot 0xffffffff: this member's own blocks, not a signal slot.
      device::record_error(a.team, kDeviceErrorWaitTimeout, a.team.rank, 0xffffffffu,
                           a.blocks_done_target, v, device::globaltimer_ns() - start);
      return false;
    }
  }
}

__device__ __forceinline__ unsigned long long load_acquire_gpu_u64(const unsigned long long* p) {
  return load_acquire_gpu(p);
}

// How many warps share one row: with few rows, a row is split so that every
// warp has work and each moves a few 16-byte vectors per lane (latency, not
// bandwidth, is what a small call pays); with many rows, one warp per row.
__device__ __forceinline__ int chunks_per_row(uint64_t row_vectors, int rows, int warps) {
  const int most = static_cast<int>((row_vectors + 31) / 32);
  if (rows <= 0) return 1;
  const int fit = warps / rows;
  return fit < 1 ? 1 : (fit < most ? fit : most);
}

// Vectors [first, end) of a row for chunk `c` of `chunks`: whole 32-vector
// groups, so that every lane of a warp runs the same iterations.
__device__ __forceinline__ void chunk_range(uint64_t row_vectors, int chunks, int c,
                                            uint64_t* first, uint64_t* end) {
  const uint64_t groups = (row_vectors + 31) / 32;
  const uint64_t per = (groups + chunks - 1) / chunks;
  *first = per * 32 * static_cast<uint64_t>(c);
  const uint64_t e = *first + per * 32;
  *end = e < row_vectors ? e : row_vectors;
  if (*first > *end) *first = *end;
}

// The slot of (token, k) in its expert's receive block, the same for every
// warp that copies a chunk of the row: the first one claims it (CAS on a word
// tagged with this call's round), takes the next slot of the expert, and
// publishes it; the others wait for it.
__device__ int claim_slot(unsigned long long* word, uint64_t round, int* counter) {
  const unsigned long long busy = (static_cast<unsigned long long>(round) << 32) | 0xffffffffull;
  for (;;) {
    const unsigned long long v = load_acquire_gpu_u64(word);
    if ((v >> 32) == round) {
      if ((v & 0xffffffffull) != 0xffffffffull) return static_cast<int>(v & 0xffffffffull);
      continue;  // another warp is taking it
    }
    if (atomicCAS(word, v, busy) == v) {
      const int slot = atomicAdd(counter, 1);
      const unsigned long long mine =
          (static_cast<unsigned long long>(round) << 32) | static_cast<unsigned int>(slot);
      asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(word), "l"(mine) : "memory");
      return slot;
    }
  }
}

__global__ void __launch_bounds__(kMoeThreadsPerBlock, 1) dispatch_kernel(MoeKernelArgs a) {
  const DeviceTeam& team = a.team;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int warps = static_cast<int>(gridDim.x) * kWarpsPerBlock;
  const int gw = static_cast<int>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x / 32);
  const int W = team.size, E = a.experts_per_rank, K = a.top_k, me = team.rank;
  const int experts = W * E;
  const uint64_t row_vectors = static_cast<uint64_t>(a.hidden) / 8;  // 8 bf16 per int4
  const uint64_t row_bytes = static_cast<uint64_t>(a.hidden) * 2;
  const auto* x = static_cast<const int4*>(a.x);
  const int items = a.num_tokens * K;

  // 1. send every (token, k) copy, split into chunks when rows are few.
  const int chunks = chunks_per_row(row_vectors, items, warps);
  for (int w = gw; w < items * chunks; w += warps) {
    const int item = w / chunks, c = w % chunks;
    const int t = item / K;
    const int64_t e = a.topk_idx[item];
    int slot = -1;
    if (lane == 0) {
      if (e >= 0 && e < experts) {
        slot = claim_slot(&a.slot_of[item], a.round, &a.slot_counter[e]);
      } else if (e >= experts && c == 0) {
        device::record_error(team, kDeviceErrorBadPeer, static_cast<int>(e / E), 0,
                             static_cast<uint64_t>(experts), static_cast<uint64_t>(e));
      }
    }
    slot = __shfl_sync(0xffffffffu, slot, 0);
    if (slot < 0) continue;
    const int dst = static_cast<int>(e) / E, le = static_cast<int>(e) % E;
    const uint64_t row = (static_cast<uint64_t>(le) * W + me) * a.max_tokens + slot;
    uint8_t* base = team.data[dst];
    uint64_t first = 0, end = 0;
    chunk_range(row_vectors, chunks, c, &first, &end);
    device::copy_vectors<true>(
        reinterpret_cast<int4*>(base + a.recv_x_offset + row * row_bytes) + first,
        x + static_cast<uint64_t>(t) * row_vectors + first, end - first, lane, 32);
    if (lane == 0 && c == 0) reinterpret_cast<int32_t*>(base + a.recv_src_offset)[row] = t;
  }
  block_sends_done(a);

  // 2. one warp per global expert: its count, after every row.
  const uint32_t parity_base = a.count_slot + static_cast<uint32_t>((a.round & 1) * E * W);
  for (int e = gw; e < experts; e += warps) {
    if (lane == 0 && wait_all_blocks(a)) {
      const int count = atomicExch(&a.slot_counter[e], 0);
      device::quiet();
      const uint32_t slot = parity_base + static_cast<uint32_t>((e % E) * W + me);
      device::signal(team, e / E, slot, (a.round << 32) | static_cast<uint32_t>(count));
    }
  }
  // 3. one warp per (local expert, source): wait for its count.
  for (int p = gw; p < E * W; p += warps) {
    if (lane == 0) {
      uint64_t v = 0;
      const bool ok =
          device::wait(team, parity_base + static_cast<uint32_t>(p), a.round << 32, 0, &v);
      a.recv_count[p] = ok ? static_cast<int32_t>(v & 0xffffffffu) : 0;
    }
  }
}

__global__ void __launch_bounds__(kMoeThreadsPerBlock, 1) combine_kernel(MoeKernelArgs a) {
  const DeviceTeam& team = a.team;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int warps = static_cast<int>(gridDim.x) * kWarpsPerBlock;
  const int gw = static_cast<int>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x / 32);
  const int W = team.size, E = a.experts_per_rank, K = a.top_k, me = team.rank;
  const uint64_t row_vectors = static_cast<uint64_t>(a.hidden) / 8;
  const uint64_t row_bytes = static_cast<uint64_t>(a.hidden) * 2;
  const auto* y = static_cast<const int4*>(a.y);
  const auto* recv_src = reinterpret_cast<const int32_t*>(team.data[me] + a.recv_src_offset);

  // 1. send each returned row to the member its token came from (in chunks
  // when rows are few). Rows of consecutive (expert, source) blocks continue
  // the warp rotation, so the load spreads evenly whatever the counts.
  int rows = 0;
  for (int p = 0; p < E * W; ++p) rows += (p % W) == me ? 0 : a.recv_count[p];
  const int chunks = chunks_per_row(row_vectors, rows, warps);
  int rotation = 0;
  for (int p = 0; p < E * W; ++p) {
    const int src = p % W, le = p / W;
    if (src == me) continue;  // read in place by this member's reduction
    const int pieces = a.recv_count[p] * chunks;
    const int first_piece = ((gw - rotation) % warps + warps) % warps;
    rotation = (rotation + pieces) % warps;
    uint8_t* dst_base = team.data[src] + a.combine_offset;
    const uint64_t dst_expert = static_cast<uint64_t>(me) * E + le;
    for (int i = first_piece; i < pieces; i += warps) {
      const int s = i / chunks, c = i % chunks;
      const uint64_t row = static_cast<uint64_t>(p) * a.max_tokens + s;
      const int t = recv_src[row];
      const uint64_t dst_row = dst_expert * a.max_tokens + static_cast<uint64_t>(t);
      uint64_t first = 0, end = 0;
      chunk_range(row_vectors, chunks, c, &first, &end);
      device::copy_vectors<true>(reinterpret_cast<int4*>(dst_base + dst_row * row_bytes) + first,
                                 y + row * row_vectors + first, end - first, lane, 32);
    }
  }
  block_sends_done(a);

  // 2. one warp per (local expert, source member): flag the rows as delivered.
  for (int p = gw; p < E * W; p += warps) {
    const int src = p % W, le = p / W;
    if (src == me || lane != 0) continue;
    if (wait_all_blocks(a)) {
      device::quiet();
      device::signal(team, src, a.flag_slot + static_cast<uint32_t>(me * E + le), a.round);
    }
  }

  // 3. one warp per token: wait for its remote experts, then the weighted sum.
  const auto* combined = reinterpret_cast<const int4*>(team.data[me] + a.combine_offset);
  auto* out = static_cast<int4*>(a.out);
  const int out_chunks = chunks_per_row(row_vectors, a.num_tokens, warps);
  for (int w = gw; w < a.num_tokens * out_chunks; w += warps) {
    const int t = w / out_chunks;
    uint64_t first = 0, end = 0;
    chunk_range(row_vectors, out_chunks, w % out_chunks, &first, &end);
    // Lane k holds the k-th choice: where its row is and its weight.
    const int64_t e = lane < K ? a.topk_idx[static_cast<uint64_t>(t) * K + lane] : -1;
    const int slot =
        lane < K ? static_cast<int>(a.slot_of[static_cast<uint64_t>(t) * K + lane] & 0xffffffffull)
                 : -1;
    const float weight = lane < K ? a.topk_weights[static_cast<uint64_t>(t) * K + lane] : 0.f;
    const int4* src_row = nullptr;
    if (e >= 0 && slot >= 0) {
      const int owner = static_cast<int>(e) / E, le = static_cast<int>(e) % E;
      if (owner == me) {
        src_row = y + ((static_cast<uint64_t>(le) * W + me) * a.max_tokens + slot) * row_vectors;
      } else {
        device::wait(team, a.flag_slot + static_cast<uint32_t>(e), a.round);
        src_row = combined + (static_cast<uint64_t>(e) * a.max_tokens + t) * row_vectors;
      }
    }
    __syncwarp();
    // Every lane runs every iteration (the shuffles need the whole warp); lanes
    // past the row's end only skip the loads and the store.
    for (uint64_t base = first; base < end; base += 32) {
      const uint64_t v = base + static_cast<uint64_t>(lane);
      const bool mine = v < end;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k = 0; k < K; ++k) {
        const int4* r = reinterpret_cast<const int4*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(src_row), k));
        const float w = __shfl_sync(0xffffffffu, weight, k);
        if (r == nullptr || !mine) continue;
        // A weak load, not the read-only path: peers wrote these rows during
        // this kernel, ordered before the flag this lane acquired.
        const int4 packed = r[v];
        const auto* h = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(h[j]);
          acc[2 * j] += w * f.x;
          acc[2 * j + 1] += w * f.y;
        }
      }
      int4 packed;
      auto* h = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
      if (mine) out[static_cast<uint64_t>(t) * row_vectors + v] = packed;
    }
  }
}

}  // namespace

cudaError_t preload_moe_kernels() {
  cudaFuncAttributes attr;
  if (cudaError_t e = cudaFuncGetAttributes(&attr, dispatch_kernel); e != cudaSuccess) return e;
  return cudaFuncGetAttributes(&attr, combine_kernel);
}

cudaError_t launch_dispatch(const MoeKernelArgs& args, int blocks, cudaStream_t stream) {
  dispatch_kernel<<<blocks, kMoeThreadsPerBlock, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_combine(const MoeKernelArgs& args, int blocks, cudaStream_t stream) {
  combine_kernel<<<blocks, kMoeThreadsPerBlock, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace ferry::symmetric
