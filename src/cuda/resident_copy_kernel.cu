// The resident copy kernel (see resident_copy_kernel.h).
//
// Thread 0 polls the next slot over PCIe (three 16-byte loads and the quit
// word in flight at once), waits for the host's decision and then the slot's
// gate where it asks for them, and hands the copy
// to the CTA through shared memory. Every thread copies its share with
// 16-byte accesses that bypass L1 (the same source buffer is copied again and
// again, rewritten by others in between; a stale L1 line would be sent),
// makes its stores visible system-wide, and thread 0 then publishes the
// slot's status. The kernel leaves after `linger_ns` without a posting, when
// told to quit, or after deferring a copy whose gate stayed shut (its work is
// then queued behind something that may need this SM), writing the ticket it
// would have taken next into the exit word.
#include "cuda/resident_copy_kernel.h"

namespace ferry::cuda {
namespace {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void load16(const uint64_t* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

__device__ __forceinline__ uint64_t load_volatile(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

__device__ __forceinline__ void store_volatile(uint64_t* p, uint64_t v) {
  *reinterpret_cast<volatile uint64_t*>(p) = v;
}

__global__ void __launch_bounds__(kResidentThreads) resident_copy(ResidentLaunch l) {
  __shared__ uint64_t s_dst, s_src, s_size;
  __shared__ int s_cmd;  // 0: copy, 1: leave, 2: defer and leave
  ResidentShared* sh = l.shared;
  uint64_t t = l.first_ticket;
  for (;;) {
    if (threadIdx.x == 0) {
      const uint64_t idle_from = now_ns();
      const ResidentSlot* slot = &sh->slots[t % kResidentSlots];
      int cmd = 1;
      for (;;) {
        uint64_t d, dt, s, st, z, zt;
        load16(&slot->dst, d, dt);
        load16(&slot->src, s, st);
        load16(&slot->size_flags, z, zt);
        // In flight with the three above: one PCIe round trip per poll.
        const uint64_t quit = load_volatile(&sh->quit);
        if (dt == t && st == t && zt == t) {
          cmd = 0;
          bool gated = (z & kResidentWaitGate) != 0;
          if ((z & kResidentDecide) != 0) {
            // The host is asking the legacy stream now; its answer follows.
            const uint64_t from = now_ns();
            const uint64_t* word = &sh->decision[t % kResidentSlots];
            uint64_t v = load_volatile(word);
            while ((v >> 2) != t) {
              if (now_ns() - from > l.gate_wait_ns) {
                cmd = 2;
                break;
              }
              v = load_volatile(word);
            }
            gated = (v & 3) == kResidentGated;
          }
          if (cmd == 0 && gated) {
            const uint64_t from = now_ns();
            while (load_volatile(l.gate) < t) {
              if (now_ns() - from > l.gate_wait_ns) {
                cmd = 2;
                break;
              }
            }
            __threadfence();  // the gated work's writes before this copy's reads
          }
          s_dst = d;
          s_src = s;
          s_size = z & ~kResidentFlags;
          break;
        }
        if (quit != 0 || now_ns() - idle_from > l.linger_ns) break;
      }
      s_cmd = cmd;
    }
    __syncthreads();
    const int cmd = s_cmd;
    if (cmd != 0) {
      if (threadIdx.x == 0) {
        if (cmd == 2) {
          store_volatile(&sh->status[t % kResidentSlots], (t << 2) | kResidentDeferred);
          ++t;
        }
        __threadfence_system();
        store_volatile(&sh->exit_word, (l.epoch << kResidentEpochShift) | t);
      }
      return;
    }
    auto* dst = reinterpret_cast<uint4*>(s_dst);
    const auto* src = reinterpret_cast<const uint4*>(s_src);
    const uint64_t size = s_size;
    const uint64_t n16 = size / 16;
    // kResidentUnroll independent loads per thread before their stores: one
    // SM then has 64 KiB in flight per round trip to memory (HBM or NVLink),
    // not 8 KiB, which is what a lone copy of 16-256 KiB waits on.
    uint64_t i = threadIdx.x;
    const uint64_t stride = blockDim.x;
    for (; i + (kResidentUnroll - 1) * stride < n16; i += kResidentUnroll * stride) {
      uint4 v[kResidentUnroll];
#pragma unroll
      for (uint32_t k = 0; k < kResidentUnroll; ++k) v[k] = __ldcg(src + i + k * stride);
#pragma unroll
      for (uint32_t k = 0; k < kResidentUnroll; ++k) __stcg(dst + i + k * stride, v[k]);
    }
    for (; i < n16; i += stride) __stcg(dst + i, __ldcg(src + i));
    for (uint64_t i = n16 * 16 + threadIdx.x; i < size; i += blockDim.x) {
      reinterpret_cast<uint8_t*>(s_dst)[i] =
          *reinterpret_cast<const volatile uint8_t*>(reinterpret_cast<const uint8_t*>(s_src) + i);
    }
    __threadfence_system();  // this thread's stores, before the status below
    __syncthreads();
    if (threadIdx.x == 0) store_volatile(&sh->status[t % kResidentSlots], (t << 2) | kResidentDone);
    ++t;
  }
}

}  // namespace

cudaError_t launch_resident_copier(const ResidentLaunch& launch, cudaStream_t stream) {
  resident_copy<<<1, kResidentThreads, 0, stream>>>(launch);
  return cudaGetLastError();
}

}  // namespace ferry::cuda
