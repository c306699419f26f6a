// SM gather/scatter copy kernel.
//
// Why this shape: a copy that reads mapped host memory is latency-bound (a
// PCIe read takes ~1 us), so link speed needs ~100 KB in flight. One warp per
// block, each lane issuing 8 independent 16-byte loads before its stores,
// keeps 4 KiB in flight per warp and 128 KiB per 1024-thread CTA, so a few
// SMs saturate the link. CTAs are persistent and stride over the descriptor
// list; a warp prefetches its next descriptor while copying the current one.
#include <cstdint>

#include "cuda/gather_kernel.h"

namespace ferry::cuda {
namespace {

struct InlineDescs {
  CopyDesc d[kInlineDescs];
};

// Streaming (evict-first) accesses: copied bytes are touched once.
__device__ __forceinline__ uint4 ld(const uint4* p) {
  return __ldcs(p);
}
__device__ __forceinline__ uint2 ld(const uint2* p) {
  return __ldcs(p);
}
__device__ __forceinline__ uint32_t ld(const uint32_t* p) {
  return __ldcs(p);
}
__device__ __forceinline__ uint16_t ld(const uint16_t* p) {
  return __ldcs(p);
}
__device__ __forceinline__ uint8_t ld(const uint8_t* p) {
  return __ldcs(p);
}
__device__ __forceinline__ void st(uint4* p, uint4 v) {
  __stcs(p, v);
}
__device__ __forceinline__ void st(uint2* p, uint2 v) {
  __stcs(p, v);
}
__device__ __forceinline__ void st(uint32_t* p, uint32_t v) {
  __stcs(p, v);
}
__device__ __forceinline__ void st(uint16_t* p, uint16_t v) {
  __stcs(p, v);
}
__device__ __forceinline__ void st(uint8_t* p, uint8_t v) {
  __stcs(p, v);
}

// Copies `n` words of type T (both pointers T-aligned) with the whole warp:
// rounds of U words per lane, all loads of a round issued before its stores.
template <typename T, int U>
__device__ __forceinline__ void warp_copy_words(T* __restrict__ d, const T* __restrict__ s,
                                                uint64_t n, uint32_t lane) {
  constexpr uint32_t kRound = 32u * U;
  // Per-lane pointers advanced per round keep offsets immediate in the loads.
  const T* sp = s + lane;
  T* dp = d + lane;
  uint64_t rounds = n / kRound;
#pragma unroll 1  // one round of loads in flight; more would spill at 1024 threads
  for (; rounds > 0; --rounds, sp += kRound, dp += kRound) {
    T v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld(sp + u * 32);
#pragma unroll
    for (int u = 0; u < U; ++u) st(dp + u * 32, v[u]);
  }
  const uint32_t rest = static_cast<uint32_t>(n % kRound);
  if (rest != 0) {  // one more round for the remainder
    // Loads clamp to the last word instead of being predicated: eight live
    // predicates would spill at 64 registers. Only the stores are predicated.
    const T* s0 = sp - lane;
    T v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t k = u * 32 + lane;
      v[u] = ld(s0 + (k < rest ? k : rest - 1));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u * 32 + lane < rest) st(dp + u * 32, v[u]);
    }
  }
}

// Copies one block whose src and dst agree modulo sizeof(T): byte head up
// to the first T-aligned address, T-words, byte tail. Head and tail bytes are
// loaded first so their latency overlaps the body's first round.
template <typename T, int U>
__device__ void warp_copy_block(uint8_t* dst, const uint8_t* src, uint64_t n, uint32_t lane) {
  constexpr uint64_t kW = sizeof(T);
  uint64_t head = (kW - (reinterpret_cast<uintptr_t>(dst) & (kW - 1))) & (kW - 1);
  if (head > n) head = n;
  const uint64_t body = (n - head) & ~(kW - 1);
  const uint64_t tail = n - head - body;
  const bool has_head = lane < head;
  const bool has_tail = lane < tail;
  uint8_t hb = 0, tb = 0;
  if (has_head) hb = ld(src + lane);
  if (has_tail) tb = ld(src + head + body + lane);
  warp_copy_words<T, U>(reinterpret_cast<T*>(dst + head), reinterpret_cast<const T*>(src + head),
                        body / kW, lane);
  if (has_head) st(dst + lane, hb);
  if (has_tail) st(dst + head + body + lane, tb);
}

__device__ __forceinline__ void warp_copy(const CopyDesc& c, uint32_t lane) {
  auto* dst = reinterpret_cast<uint8_t*>(c.dst);
  auto* src = reinterpret_cast<const uint8_t*>(c.src);
  // The widest access both sides can share at the same offset.
  const uint32_t mis = static_cast<uint32_t>(c.dst ^ c.src);
  if ((mis & 15) == 0) {
    warp_copy_block<uint4, 8>(dst, src, c.size, lane);
  } else if ((mis & 7) == 0) {
    warp_copy_block<uint2, 8>(dst, src, c.size, lane);
  } else if ((mis & 3) == 0) {
    warp_copy_block<uint32_t, 16>(dst, src, c.size, lane);
  } else if ((mis & 1) == 0) {
    warp_copy_block<uint16_t, 16>(dst, src, c.size, lane);
  } else {
    warp_copy_block<uint8_t, 16>(dst, src, c.size, lane);
  }
}

__device__ __forceinline__ CopyDesc load_desc(const CopyDesc* p) {
  // Every lane reads the same 24 bytes: one broadcast transaction.
  CopyDesc c;
  c.dst = p->dst;
  c.src = p->src;
  c.size = p->size;
  return c;
}

__device__ __forceinline__ void copy_descs(const CopyDesc* descs, uint32_t count,
                                           uint32_t* sm_mask) {
  if (sm_mask != nullptr && threadIdx.x == 0) {
    uint32_t smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    atomicOr(&sm_mask[(smid >> 5) & 7], 1u << (smid & 31));
  }
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t nwarps = (gridDim.x * blockDim.x) >> 5;
  uint32_t i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (i >= count) return;
  CopyDesc cur = load_desc(descs + i);
  for (;;) {
    const uint32_t next = i + nwarps;
    CopyDesc nxt{0, 0, 0};
    if (next < count) nxt = load_desc(descs + next);  // in flight during the copy
    warp_copy(cur, lane);
    if (next >= count) break;
    cur = nxt;
    i = next;
  }
}

__global__ void __launch_bounds__(kGatherThreads, 1)
    gather_kernel(const CopyDesc* __restrict__ descs, uint32_t count, uint32_t* sm_mask) {
  copy_descs(descs, count, sm_mask);
}

__global__ void __launch_bounds__(kGatherThreads, 1)
    gather_inline_kernel(const __grid_constant__ InlineDescs descs, uint32_t count,
                         uint32_t* sm_mask) {
  copy_descs(descs.d, count, sm_mask);
}

}  // namespace

cudaError_t launch_gather(const CopyDesc* host_descs, const CopyDesc* dev_descs, uint32_t count,
                          uint32_t max_ctas, uint32_t* sm_mask, cudaStream_t stream,
                          uint32_t* ctas) {
  if (ctas != nullptr) *ctas = 0;
  if (count == 0) return cudaSuccess;
  if (max_ctas == 0) return cudaErrorInvalidValue;
  constexpr uint32_t kWarps = kGatherThreads / 32;
  // Enough CTAs for one descriptor per warp, at most the budget.
  uint32_t grid = (count + kWarps - 1) / kWarps;
  if (grid > max_ctas) grid = max_ctas;
  const uint32_t threads = grid == 1 ? ((count < kWarps ? count : kWarps) * 32) : kGatherThreads;
  if (count <= kInlineDescs) {
    InlineDescs p;
    for (uint32_t k = 0; k < count; ++k) p.d[k] = host_descs[k];
    gather_inline_kernel<<<grid, threads, 0, stream>>>(p, count, sm_mask);
  } else {
    gather_kernel<<<grid, threads, 0, stream>>>(dev_descs, count, sm_mask);
  }
  if (ctas != nullptr) *ctas = grid;
  return cudaGetLastError();
}

}  // namespace ferry::cuda
