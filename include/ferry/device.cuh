// Ferry's device API: GPU-initiated put / signal / wait over a symmetric group
// (include/ferry/symmetric.h creates the group; include/ferry/device_team.h is
// the DeviceTeam a kernel takes). Header-only, CUDA C++17, sm_70 and newer.
//
//   __global__ void k(ferry::DeviceTeam team, const int4* src, uint64_t n) {
//     const int peer = (team.rank + 1) % team.size;
//     ferry::device::put_block(team, peer, /*dst_offset=*/0, src, n);
//     ferry::device::signal_block(team, peer, /*slot=*/0, 1, ferry::device::SignalOp::kAdd);
//     ferry::device::wait(team, /*slot=*/0, /*at_least=*/1);  // the peer's put to us
//   }
//
// Memory ordering, in the PTX memory model's terms:
//  - put_*: weak (plain) 16-byte stores into the peer's memory; no ordering
//    among them, no completion. They become visible to the peer no later than
//    a later signal by the same thread (or, for put_warp/put_block, by any
//    thread of the warp/block after the matching signal_warp/signal_block).
//  - signal / signal_warp / signal_block: a release at system scope on the
//    peer's 64-bit slot (st.release.sys or red.release.sys.add). Everything the
//    signalling thread (warp, block) wrote before it -- puts to any member,
//    local stores -- is visible to whoever observes the new value with an
//    acquire (wait). Signals are atomic; concurrent adds from any number of
//    threads and members all count.
//  - wait: acquire at system scope; returns once the local slot is >= the
//    value. Data written before the matching signal is visible to the waiting
//    thread after it returns (and to its block after a __syncthreads()).
//  - fence: orders this thread's earlier puts and signals before its later
//    ones, to every member (fence.acq_rel.sys). quiet: waits until this thread's
//    earlier puts are complete at their targets (fence.sc.sys); on NVLink the
//    two cost the same, on a network backend quiet is the expensive one.
//
// Errors never hang or trap: a wait that times out, a peer or slot out of
// range, a put past the data area record a DeviceError (the first one wins) in
// host-mapped memory that SymmetricMemory::device_error() reads, and the call
// returns false.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "ferry/device_team.h"

namespace ferry::device {

enum class SignalOp : int { kSet = 0, kAdd = 1 };

// --- low-level primitives ------------------------------------------------------

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ void quiet() {
  asm volatile("fence.sc.sys;" ::: "memory");
}

// Source loads through the non-coherent read-only path, bypassing L1: only for
// data no thread writes while the kernel runs (inputs made by earlier kernels).
__device__ __forceinline__ int4 load_stream(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void store_stream(int4* p, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

template <bool kReadOnlySource>
__device__ __forceinline__ int4 load_source(const int4* p) {
  if constexpr (kReadOnlySource) {
    return load_stream(p);
  } else {
    return *p;  // weak load: sees what this kernel wrote before a barrier or fence
  }
}

// Copies `n` 16-byte vectors; thread `lane` of `width` cooperating threads
// takes vectors lane, lane + width, ... Four loads are in flight before the
// stores, so one warp keeps enough bytes moving to fill NVLink with few SMs.
// kReadOnlySource: the source is not written while the kernel runs (faster loads).
template <bool kReadOnlySource = false>
__device__ __forceinline__ void copy_vectors(int4* dst, const int4* src, uint64_t n, uint32_t lane,
                                             uint32_t width) {
  constexpr uint32_t kUnroll = 4;
  uint64_t i = lane;
  for (; i + (kUnroll - 1) * width < n; i += kUnroll * width) {
    int4 v[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) v[u] = load_source<kReadOnlySource>(src + i + u * width);
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) store_stream(dst + i + u * width, v[u]);
  }
  for (; i < n; i += width) store_stream(dst + i, load_source<kReadOnlySource>(src + i));
}

// Any alignment: 16-byte vectors where dst, src and n allow, bytes otherwise.
__device__ __forceinline__ void copy_bytes(void* dst, const void* src, uint64_t n, uint32_t lane,
                                           uint32_t width) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (((d | s | n) & 15u) == 0) {
    copy_vectors(static_cast<int4*>(dst), static_cast<const int4*>(src), n / 16, lane, width);
    return;
  }
  auto* db = static_cast<uint8_t*>(dst);
  const auto* sb = static_cast<const uint8_t*>(src);
  for (uint64_t i = lane; i < n; i += width) db[i] = sb[i];
}

// --- errors --------------------------------------------------------------------

// The first error wins: a thread claims the record (code 0 -> busy), fills it,
// then publishes the code, so the host never reads a half-written record.
__device__ __forceinline__ void record_error(const DeviceTeam& t, uint32_t code, int peer,
                                             uint32_t slot, uint64_t expected, uint64_t observed,
                                             uint64_t waited_ns = 0) {
  constexpr uint32_t kBusy = 0xffffffffu;
  if (t.error == nullptr) return;
  if (atomicCAS_system(&t.error->code, 0u, kBusy) != 0u) return;
  t.error->rank = t.rank;
  t.error->peer = peer;
  t.error->slot = slot;
  t.error->expected = expected;
  t.error->observed = observed;
  t.error->waited_ns = waited_ns;
  t.error->block = blockIdx.x;
  t.error->thread = threadIdx.x;
  __threadfence_system();
  atomicExch_system(&t.error->code, code);
}

__device__ __forceinline__ bool check_peer(const DeviceTeam& t, int peer) {
  if (peer >= 0 && peer < t.size) return true;
  record_error(t, kDeviceErrorBadPeer, peer, 0, static_cast<uint64_t>(t.size), 0);
  return false;
}

__device__ __forceinline__ bool check_slot(const DeviceTeam& t, int peer, uint32_t slot) {
  if (slot < t.signal_slots + t.reserved_slots) return true;
  record_error(t, kDeviceErrorBadSlot, peer, slot, t.signal_slots, 0);
  return false;
}

__device__ __forceinline__ bool check_range(const DeviceTeam& t, int peer, uint64_t offset,
                                            uint64_t bytes) {
  if (offset <= t.data_bytes && bytes <= t.data_bytes - offset) return true;
  record_error(t, kDeviceErrorOutOfRange, peer, 0, offset + bytes, t.data_bytes);
  return false;
}

// --- addresses -----------------------------------------------------------------

// Member `peer`'s data at `offset`, as mapped here: for the application's own
// loads and stores (they follow the same ordering rules as put).
__device__ __forceinline__ void* peer_ptr(const DeviceTeam& t, int peer, uint64_t offset) {
  return t.data[peer] + offset;
}
__device__ __forceinline__ uint64_t* signal_ptr(const DeviceTeam& t, int peer, uint32_t slot) {
  return t.signals[peer] + slot;
}

// --- put -----------------------------------------------------------------------

// One thread copies `bytes` from local `src` to member `peer`'s data at `dst_offset`.
__device__ __forceinline__ bool put_thread(const DeviceTeam& t, int peer, uint64_t dst_offset,
                                           const void* src, uint64_t bytes) {
  if (!check_peer(t, peer) || !check_range(t, peer, dst_offset, bytes)) return false;
  copy_bytes(t.data[peer] + dst_offset, src, bytes, 0, 1);
  return true;
}

// The 32 threads of a warp, all with the same arguments, copy together.
__device__ __forceinline__ bool put_warp(const DeviceTeam& t, int peer, uint64_t dst_offset,
                                         const void* src, uint64_t bytes) {
  const uint32_t lane = threadIdx.x & 31u;
  if (!check_peer(t, peer) || !check_range(t, peer, dst_offset, bytes)) return false;
  copy_bytes(t.data[peer] + dst_offset, src, bytes, lane, 32);
  return true;
}

// Every thread of the block, all with the same arguments, copies together.
__device__ __forceinline__ bool put_block(const DeviceTeam& t, int peer, uint64_t dst_offset,
                                          const void* src, uint64_t bytes) {
  const uint32_t n = blockDim.x * blockDim.y * blockDim.z;
  const uint32_t me = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  if (!check_peer(t, peer) || !check_range(t, peer, dst_offset, bytes)) return false;
  copy_bytes(t.data[peer] + dst_offset, src, bytes, me, n);
  return true;
}

// --- signal --------------------------------------------------------------------

// Sets or adds `value` on member `peer`'s slot with release semantics at system
// scope: this thread's earlier writes are visible before the new value.
__device__ __forceinline__ bool signal(const DeviceTeam& t, int peer, uint32_t slot, uint64_t value,
                                       SignalOp op = SignalOp::kSet) {
  if (!check_peer(t, peer) || !check_slot(t, peer, slot)) return false;
  uint64_t* p = t.signals[peer] + slot;
  if (op == SignalOp::kAdd) {
    add_release_sys(p, value);
  } else {
    store_release_sys(p, value);
  }
  return true;
}

// After put_warp: every lane's puts are ordered before the signal (lane 0 sends it).
__device__ __forceinline__ bool signal_warp(const DeviceTeam& t, int peer, uint32_t slot,
                                            uint64_t value, SignalOp op = SignalOp::kSet) {
  __syncwarp();
  bool ok = true;
  if ((threadIdx.x & 31u) == 0) {
    fence();
    ok = signal(t, peer, slot, value, op);
  }
  return __shfl_sync(0xffffffffu, ok, 0);
}

// After put_block: every thread's puts are ordered before the signal (thread 0 sends it).
__device__ __forceinline__ bool signal_block(const DeviceTeam& t, int peer, uint32_t slot,
                                             uint64_t value, SignalOp op = SignalOp::kSet) {
  __shared__ int ok_shared;
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    fence();
    ok_shared = signal(t, peer, slot, value, op) ? 1 : 0;
  }
  __syncthreads();
  return ok_shared != 0;
}

// --- wait ----------------------------------------------------------------------

// Waits (acquire, system scope) until this member's `slot` is >= `at_least`.
// After `timeout_ns` (0: the team's default) it records kDeviceErrorWaitTimeout
// and returns false. `observed`, if given, receives the slot's last value.
__device__ __forceinline__ bool wait(const DeviceTeam& t, uint32_t slot, uint64_t at_least,
                                     uint64_t timeout_ns = 0, uint64_t* observed = nullptr) {
  if (!check_slot(t, t.rank, slot)) return false;
  const uint64_t* p = t.signals[t.rank] + slot;
  const uint64_t limit = timeout_ns != 0 ? timeout_ns : t.timeout_ns;
  uint64_t v = load_acquire_sys(p);
  if (v >= at_least) {
    if (observed != nullptr) *observed = v;
    return true;
  }
  const uint64_t start = globaltimer_ns();
  for (uint32_t spins = 0;; ++spins) {
    v = load_acquire_sys(p);
    if (v >= at_least) break;
    if ((spins & 63u) == 63u) {
      const uint64_t waited = globaltimer_ns() - start;
      if (waited > limit) {
        record_error(t, kDeviceErrorWaitTimeout, t.rank, slot, at_least, v, waited);
        if (observed != nullptr) *observed = v;
        return false;
      }
    }
  }
  if (observed != nullptr) *observed = v;
  return true;
}

// Reads this member's slot now (acquire, system scope).
__device__ __forceinline__ uint64_t read_signal(const DeviceTeam& t, uint32_t slot) {
  return load_acquire_sys(t.signals[t.rank] + slot);
}

}  // namespace ferry::device
