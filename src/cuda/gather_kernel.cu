// SM gather/scatter copy kernel.
//
// Why this shape: a copy that reads mapped host memory is latency-bound (a
// PCIe read takes ~1 us), so link speed needs ~100 KB in flight. One warp per
// block, each lane issuing 8 independent 16-byte loads before its stores,
// keeps 4 KiB in flight per warp and 128 KiB per 1024-thread CTA, so a few
// SMs saturate the link. CTAs are persistent and stride over the descriptor
// list; a warp prefetches its next group of descriptors while copying the
// current one.
#include <cstdint>

#include "cuda/gather_kernel.h"

namespace ferry::cuda {
namespace {

struct InlineDescs {
  CopyDesc d[kInlineDescs];
};

// Most descriptors a warp fetches at once (3 words each, from lanes 0..23).
constexpr uint32_t kMaxGroup = 8;

// Data loads. Device memory: streaming (evict-first), the bytes are read once.
// Host memory: per HostLoad.
enum class Load : uint8_t { kStreaming, kFetchAgain, kPrefetch256 };

template <Load L, typename T>
__device__ __forceinline__ T ld(const T* p) {
  if constexpr (L == Load::kStreaming) {
    return __ldcs(p);
  } else {
    return __ldcv(p);  // narrow accesses use fetch-again for both host policies
  }
}

template <>
__device__ __forceinline__ uint4 ld<Load::kPrefetch256, uint4>(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <typename T>
__device__ __forceinline__ void st(T* p, T v) {
  __stcs(p, v);
}

// Copies `n` words of type T (both pointers T-aligned) with the whole warp:
// rounds of U words per lane, all loads of a round issued before its stores.
template <Load L, typename T, int U>
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
    for (int u = 0; u < U; ++u) v[u] = ld<L>(sp + u * 32);
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
      v[u] = ld<L>(s0 + (k < rest ? k : rest - 1));
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
template <Load L, typename T, int U>
__device__ void warp_copy_block(uint8_t* dst, const uint8_t* src, uint64_t n, uint32_t lane) {
  constexpr uint64_t kW = sizeof(T);
  uint64_t head = (kW - (reinterpret_cast<uintptr_t>(dst) & (kW - 1))) & (kW - 1);
  if (head > n) head = n;
  const uint64_t body = (n - head) & ~(kW - 1);
  const uint64_t tail = n - head - body;
  const bool has_head = lane < head;
  const bool has_tail = lane < tail;
  uint8_t hb = 0, tb = 0;
  if (has_head) hb = ld<L>(src + lane);
  if (has_tail) tb = ld<L>(src + head + body + lane);
  warp_copy_words<L, T, U>(reinterpret_cast<T*>(dst + head), reinterpret_cast<const T*>(src + head),
                           body / kW, lane);
  if (has_head) st(dst + lane, hb);
  if (has_tail) st(dst + head + body + lane, tb);
}

template <Load L>
__device__ __forceinline__ void warp_copy_as(uint8_t* dst, const uint8_t* src, uint64_t n,
                                             uint32_t lane) {
  // The widest access both sides can share at the same offset.
  const uint32_t mis =
      static_cast<uint32_t>(reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src));
  if ((mis & 15) == 0) {
    warp_copy_block<L, uint4, 8>(dst, src, n, lane);
  } else if ((mis & 7) == 0) {
    warp_copy_block<L, uint2, 8>(dst, src, n, lane);
  } else if ((mis & 3) == 0) {
    warp_copy_block<L, uint32_t, 16>(dst, src, n, lane);
  } else if ((mis & 1) == 0) {
    warp_copy_block<L, uint16_t, 16>(dst, src, n, lane);
  } else {
    warp_copy_block<L, uint8_t, 16>(dst, src, n, lane);
  }
}

template <HostLoad H>
__device__ __forceinline__ void warp_copy(const CopyDesc& c, uint32_t lane) {
  auto* dst = reinterpret_cast<uint8_t*>(c.dst);
  auto* src = reinterpret_cast<const uint8_t*>(c.src);
  const uint64_t n = c.size & ~kSrcIsHost;
  if ((c.size & kSrcIsHost) == 0) {
    warp_copy_as<Load::kStreaming>(dst, src, n, lane);
  } else if constexpr (H == HostLoad::kStreaming) {
    warp_copy_as<Load::kStreaming>(dst, src, n, lane);
  } else if constexpr (H == HostLoad::kPrefetch256) {
    warp_copy_as<Load::kPrefetch256>(dst, src, n, lane);
  } else {
    warp_copy_as<Load::kFetchAgain>(dst, src, n, lane);
  }
}

// Descriptors are walked in groups of G consecutive ones: lanes 0..3G-1 load
// the group's 3G words with one coalesced load (192 bytes for G = 8), and the
// warp takes the fields from them by shuffle. One descriptor per load would
// cost three small PCIe reads per block -- ~5% of the link at 4 KiB blocks.
template <bool kInline>
__device__ __forceinline__ uint64_t load_group_word(const uint64_t* words, uint32_t count,
                                                    uint32_t grp, uint32_t lane, uint32_t g) {
  // Lane l holds word l of the group: field l % 3 of descriptor grp * g + l / 3.
  const uint32_t d = grp * g + lane / 3;
  if (lane >= 3 * g || d >= count) return 0;
  const uint64_t k = 3ull * grp * g + lane;
  // Staging memory is rewritten between batches: fetch again, never a cached line.
  return kInline ? words[k] : __ldcv(words + k);
}

template <HostLoad H, bool kInline>
__device__ __forceinline__ void copy_descs(const CopyDesc* descs, uint32_t count, uint32_t g,
                                           uint32_t* sm_mask) {
  if (sm_mask != nullptr && threadIdx.x == 0) {
    uint32_t smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    atomicOr(&sm_mask[(smid >> 5) & 7], 1u << (smid & 31));
  }
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t nwarps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t groups = (count + g - 1) / g;
  const auto* words = reinterpret_cast<const uint64_t*>(descs);
  uint32_t grp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (grp >= groups) return;
  uint64_t cur = load_group_word<kInline>(words, count, grp, lane, g);
  for (;;) {
    const uint32_t next = grp + nwarps;
    // The next group's words are in flight while this group is copied.
    const uint64_t nxt = next < groups ? load_group_word<kInline>(words, count, next, lane, g) : 0;
    const uint32_t n = min(g, count - grp * g);
    for (uint32_t k = 0; k < n; ++k) {
      CopyDesc c;
      c.dst = __shfl_sync(0xffffffffu, cur, 3 * k);
      c.src = __shfl_sync(0xffffffffu, cur, 3 * k + 1);
      c.size = __shfl_sync(0xffffffffu, cur, 3 * k + 2);
      warp_copy<H>(c, lane);
    }
    if (next >= groups) break;
    cur = nxt;
    grp = next;
  }
}

template <HostLoad H>
__global__ void __launch_bounds__(kGatherThreads, 1)
    gather_kernel(const CopyDesc* descs, uint32_t count, uint32_t g, uint32_t* sm_mask) {
  copy_descs<H, false>(descs, count, g, sm_mask);
}

template <HostLoad H>
__global__ void __launch_bounds__(kGatherThreads, 1)
    gather_inline_kernel(const __grid_constant__ InlineDescs descs, uint32_t count, uint32_t g,
                         uint32_t* sm_mask) {
  copy_descs<H, true>(descs.d, count, g, sm_mask);
}

template <HostLoad H>
void launch(const CopyDesc* host_descs, const CopyDesc* dev_descs, uint32_t count, uint32_t grid,
            uint32_t threads, uint32_t g, uint32_t* sm_mask, cudaStream_t stream) {
  if (count <= kInlineDescs) {
    InlineDescs p;
    for (uint32_t k = 0; k < count; ++k) p.d[k] = host_descs[k];
    gather_inline_kernel<H><<<grid, threads, 0, stream>>>(p, count, g, sm_mask);
  } else {
    gather_kernel<H><<<grid, threads, 0, stream>>>(dev_descs, count, g, sm_mask);
  }
}

}  // namespace

cudaError_t launch_gather(const CopyDesc* host_descs, const CopyDesc* dev_descs, uint32_t count,
                          uint32_t max_ctas, GatherConfig config, uint32_t* sm_mask,
                          cudaStream_t stream, uint32_t* ctas) {
  if (ctas != nullptr) *ctas = 0;
  if (count == 0) return cudaSuccess;
  if (max_ctas == 0) return cudaErrorInvalidValue;
  constexpr uint32_t kWarps = kGatherThreads / 32;
  // Enough CTAs for one descriptor per warp, at most the budget.
  uint32_t grid = (count + kWarps - 1) / kWarps;
  if (grid > max_ctas) grid = max_ctas;
  const uint32_t threads = grid == 1 ? ((count < kWarps ? count : kWarps) * 32) : kGatherThreads;
  // Group size: up to kMaxGroup descriptors per warp step, smaller when the
  // batch is too short to give every warp a few groups.
  const uint32_t warps = grid * threads / 32;
  uint32_t g = kMaxGroup;
  while (g > 1 && count < warps * g * 2) g /= 2;
  switch (config.host_load) {
    case HostLoad::kStreaming:
      launch<HostLoad::kStreaming>(host_descs, dev_descs, count, grid, threads, g, sm_mask, stream);
      break;
    case HostLoad::kPrefetch256:
      launch<HostLoad::kPrefetch256>(host_descs, dev_descs, count, grid, threads, g, sm_mask,
                                     stream);
      break;
    default:
      launch<HostLoad::kFetchAgain>(host_descs, dev_descs, count, grid, threads, g, sm_mask,
                                    stream);
      break;
  }
  if (ctas != nullptr) *ctas = grid;
  return cudaGetLastError();
}

}  // namespace ferry::cuda
