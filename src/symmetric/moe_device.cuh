// Device helpers shared by the MoE dispatch and combine kernels: how work is
// split over warps, the "last unit" count that replaces a grid barrier, and
// the warp-wide copies that read a row once and write it to many places.
#pragma once

#include <cuda_bf16.h>

#include "ferry/device.cuh"
#include "symmetric/moe_kernels.h"

namespace ferry::symmetric::moe {

constexpr int kWarpsPerBlock = kMoeThreadsPerBlock / 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kUnroll = 4;  // 16-byte vectors in flight per lane
// Row vectors per lane that a low-latency receiver polls with the row's meta
// record (RoundPoll::load_record): one covers a 1-token call's chunks (32
// vectors); two spilled registers on sm_90.
constexpr int kRecordBatch = 1;

struct Grid {
  int lane;
  int warp;   // this warp's index in the grid
  int warps;  // warps in the grid
};

__device__ __forceinline__ Grid grid() {
  Grid g;
  g.lane = static_cast<int>(threadIdx.x & 31u);
  g.warps = static_cast<int>(gridDim.x) * kWarpsPerBlock;
  g.warp = static_cast<int>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x / 32);
  return g;
}

// How many warps share one row: with few rows, a row is split so that every
// warp has work and each moves a few 16-byte vectors per lane (latency, not
// bandwidth, is what a small call pays); with many rows, one warp per row.
__device__ __forceinline__ int chunks_per_row(uint64_t row_vectors, int rows, int warps) {
  const int most = static_cast<int>((row_vectors + 31) / 32);
  if (rows <= 0) return most;
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

// Called by every lane of a warp after one unit of work: true in every lane
// of the warp that finished the last of `total` units. Every unit's atomics
// on this GPU (the slot counters) are ordered before the increment (release
// at GPU scope), and the last warp orders what it does next after all of them
// (acquire), so it can read and reset the counters. It resets the count.
__device__ __forceinline__ bool finish_unit(unsigned int* done, unsigned int total, int lane) {
  __syncwarp();
  int last = 0;
  if (lane == 0) {
    __threadfence();
    last = atomicAdd(done, 1u) == total - 1 ? 1 : 0;
    if (last) {
      __threadfence();
      atomicExch(done, 0u);
    }
  }
  last = __shfl_sync(kFullMask, last, 0);
  if (last) {
    __syncwarp();
    __threadfence();
  }
  return last != 0;
}

// Lane 0 polls (relaxed, system scope) until this member's `slot` is >=
// at_least; every lane gets the value (0 after a timeout, which the team's
// error record holds). No acquire: for signals that order no data.
__device__ __forceinline__ uint64_t warp_poll(const DeviceTeam& team, uint32_t slot,
                                              uint64_t at_least, int lane) {
  unsigned long long v = 0;
  if (lane == 0) {
    const uint64_t* p = team.signals[team.rank] + slot;
    uint64_t start = 0;
    for (uint32_t spins = 0;; ++spins) {
      asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
      if (v >= at_least) break;
      if ((spins & 255u) == 255u) {
        const uint64_t now = device::globaltimer_ns();
        if (start == 0) {
          start = now;
        } else if (now - start > team.timeout_ns) {
          device::record_error(team, kDeviceErrorWaitTimeout, team.rank, slot, at_least, v,
                               now - start);
          v = 0;
          break;
        }
      }
    }
  }
  return __shfl_sync(kFullMask, v, 0);
}

// Data a peer wrote during this kernel (staged rows, meta records, partial
// rows), read after the acquire of its flag: from L2, never from this SM's
// L1. The acquire invalidates L1, but another warp of the SM may have a load
// of a neighbouring value in flight whose fill lands after the invalidation
// and carries the line as it was before the peer's write; a weak load of ours
// could then hit that stale line. No row is read twice, so L1 gains nothing.
__device__ __forceinline__ int4 load_peer(const int4* p) {
  return __ldcg(p);
}

// Vectors [first, first + 32 x kStagedBatch) of a row a peer wrote, lane's
// share (fan_copy<false, kStagedBatch>'s first vectors).
constexpr int kStagedBatch = 2;  // kUnroll spilled registers on sm_90
__device__ __forceinline__ void load_peer_batch(const int4* src, uint64_t first, uint64_t end,
                                                int lane, int4 (&v)[kStagedBatch]) {
#pragma unroll
  for (int u = 0; u < kStagedBatch; ++u) {
    const uint64_t i = first + static_cast<uint64_t>(u * 32 + lane);
    v[u] = i < end ? load_peer(src + i) : make_int4(0, 0, 0, 0);
  }
}

// Relaxed store at system scope of a staged group's flag, after the fence that
// orders the group's data before it.
__device__ __forceinline__ void store_flag(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// One warp copies vectors [first, end) of the row at `src` to every lane's
// `dst` among `dst_lanes` (a row start each): each vector is loaded once and
// stored to every destination. Every lane must call it with the same
// arguments except `dst`. kReadOnlySource: `src` is not written while the
// kernel runs (the read-only path); otherwise a peer wrote it (load_peer).
// `batch` holds the lane's share of the first kBatch x 32 vectors, loaded by
// the caller (load_peer_batch) while it did other work.
template <bool kReadOnlySource, int kBatch = 0>
__device__ __forceinline__ void fan_copy(const int4* src, int4* dst, unsigned dst_lanes,
                                         uint64_t first, uint64_t end, int lane,
                                         const int4* batch = nullptr) {
  for (uint64_t base = first; base < end; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = base + static_cast<uint64_t>(u * 32 + lane);
      if (u < kBatch && base == first) {
        v[u] = batch[u];
      } else if constexpr (kReadOnlySource) {
        v[u] = i < end ? device::load_stream(src + i) : make_int4(0, 0, 0, 0);
      } else {
        v[u] = i < end ? load_peer(src + i) : make_int4(0, 0, 0, 0);
      }
    }
    for (unsigned m = dst_lanes; m != 0; m &= m - 1) {
      const int from = __ffs(static_cast<int>(m)) - 1;
      auto* d = reinterpret_cast<int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(dst), from));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t i = base + static_cast<uint64_t>(u * 32 + lane);
        if (i < end) device::store_stream(d + i, v[u]);
      }
    }
  }
}

// --- low-latency lines (moe_kernels.h) ---------------------------------------
// A row vector (16 bytes) travels as two line vectors {x, flag, y, flag} and
// {z, flag, w, flag}, each stored and loaded 16 bytes at once (volatile: no
// cache holds a stale copy); the hardware keeps each 8-byte half whole, so a
// reader that sees both flags sees both data words. No fence is needed.

__device__ __forceinline__ void ll_store(int4* p, uint32_t lo, uint32_t hi, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(lo), "r"(flag),
               "r"(hi), "r"(flag)
               : "memory");
}

// Row vector i of a line row.
__device__ __forceinline__ void ll_store_vector(int4* line_row, uint64_t i, const int4& v,
                                                uint32_t flag) {
  ll_store(line_row + 2 * i, static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), flag);
  ll_store(line_row + 2 * i + 1, static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w), flag);
}

// One line vector, loaded 16 bytes at once (volatile: no cache holds a stale
// copy). Its data words are .x and .z, its flags .y and .w.
__device__ __forceinline__ uint4 load_line(const int4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Polls what a peer writes with this round's flag: line vectors (their flags
// inline) and the flags of staged groups. After the team's timeout it records
// an error naming the sender (kDeviceErrorLineTimeout for lines,
// kDeviceErrorFlagTimeout for staged data; the first error wins) and gives up:
// that poll and every later one of this object return at once, so that a dead
// or stopped sender costs one timeout, not one per vector.
struct RoundPoll {
  const DeviceTeam& team;
  uint32_t flag;
  bool failed = false;

  __device__ RoundPoll(const DeviceTeam& t, uint32_t f) : team(t), flag(f) {}

  // The two data words of line vector `p`, written by member `peer`.
  __device__ __forceinline__ uint2 load(const int4* p, int peer) {
    uint64_t start = 0;
    for (uint32_t spins = 0; !failed; ++spins) {
      const uint4 v = load_line(p);
      if (v.y == flag && v.w == flag) return make_uint2(v.x, v.z);
      if ((spins & 255u) == 255u) {
        give_up_after_timeout(start, peer, v.y != flag ? v.y : v.w, kDeviceErrorLineTimeout);
      }
    }
    return make_uint2(0, 0);
  }

  // Waits until the flag at `p`, written by member `peer` after its data, is
  // this round's (acquire, system scope: the caller's later loads see the
  // data). False after the timeout.
  __device__ __forceinline__ bool wait_flag(const uint32_t* p, int peer) {
    uint64_t start = 0;
    for (uint32_t spins = 0; !failed; ++spins) {
      uint32_t v;
      asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
      if (v == flag) return true;
      if ((spins & 255u) == 255u) give_up_after_timeout(start, peer, v, kDeviceErrorFlagTimeout);
    }
    return false;
  }

  // Called every few hundred polls: the first call starts the clock.
  __device__ __forceinline__ void give_up_after_timeout(uint64_t& start, int peer, uint32_t seen,
                                                        uint32_t code) {
    const uint64_t now = device::globaltimer_ns();
    if (start == 0) {
      start = now;
    } else if (now - start > team.timeout_ns) {
      device::record_error(team, code, peer, 0, flag, seen, now - start);
      failed = true;
    }
  }

  // A row vector from its two line vectors `lo` and `hi`: true (and *out set)
  // when both carry this round's flag; else *seen gets a flag that does not.
  __device__ __forceinline__ bool row_vector(const uint4& lo, const uint4& hi, int4* out,
                                             uint32_t* seen) const {
    if (lo.y == flag && lo.w == flag && hi.y == flag && hi.w == flag) {
      *out = make_int4(static_cast<int>(lo.x), static_cast<int>(lo.z), static_cast<int>(hi.x),
                       static_cast<int>(hi.z));
      return true;
    }
    *seen = lo.y != flag ? lo.y : (lo.w != flag ? lo.w : (hi.y != flag ? hi.y : hi.w));
    return false;
  }

  // Row vector i of a line row written by member `peer`: both of its line
  // vectors are loaded in each poll, so that one that is there costs one
  // round trip, not two.
  __device__ __forceinline__ int4 load_vector(const int4* line_row, uint64_t i, int peer) {
    const int4* p = line_row + 2 * i;
    uint64_t start = 0;
    for (uint32_t spins = 0; !failed; ++spins) {
      const uint4 lo = load_line(p), hi = load_line(p + 1);
      int4 v;
      uint32_t seen = flag;
      if (row_vector(lo, hi, &v, &seen)) return v;
      if ((spins & 255u) == 255u) give_up_after_timeout(start, peer, seen, kDeviceErrorLineTimeout);
    }
    return make_int4(0, 0, 0, 0);
  }

  // The headers of `tokens` consecutive lines of member `peer` (token t's at
  // line0 + t x stride; lane t < tokens gets its count n, at most K) and the
  // first 32 entries of their meta records (lane i < tokens x K: entry i % K
  // of token i / K, where that is below the token's count; else {~0, 0}), all
  // loaded in each poll: records that are there cost one round trip. False
  // after a timeout.
  __device__ __forceinline__ bool load_headers(const int4* line0, uint64_t stride, int tokens,
                                               int K, int peer, int lane, int* n, uint2* entry) {
    const int entries = tokens * K;
    const int te = lane / K, je = lane % K;  // this lane's entry, where lane < entries
    uint64_t start = 0;
    for (uint32_t spins = 0; !failed; ++spins) {
      uint4 head = make_uint4(0, 0, 0, 0), mine = make_uint4(0, 0, 0, 0);
      if (lane < tokens) head = load_line(line0 + static_cast<uint64_t>(lane) * stride);
      if (lane < entries) mine = load_line(line0 + static_cast<uint64_t>(te) * stride + 1 + je);
      uint32_t seen = flag;
      if (__all_sync(kFullMask, lane >= tokens || (head.y == flag && head.w == flag))) {
        const int count = lane < tokens ? min(static_cast<int>(head.x), K) : 0;
        const int count_e = __shfl_sync(kFullMask, count, te < tokens ? te : 0);
        const bool need = lane < entries && te < tokens && je < count_e;
        if (__all_sync(kFullMask, !need || (mine.y == flag && mine.w == flag))) {
          *n = count;
          *entry = need ? make_uint2(mine.x, mine.z) : make_uint2(0xffffffffu, 0);
          return true;
        }
        seen = mine.y;
      } else {
        seen = head.y;
      }
      if ((spins & 255u) == 255u) {
        int gave_up = 0;
        if (lane == 0) {
          give_up_after_timeout(start, peer, seen, kDeviceErrorLineTimeout);
          gave_up = failed ? 1 : 0;
        }
        failed = __shfl_sync(kFullMask, gave_up, 0) != 0;
      }
    }
    *n = 0;
    *entry = make_uint2(0xffffffffu, 0);
    return false;
  }

  // A line's meta record and the first vectors of its row, written by member
  // `peer`, by the whole warp, all loaded in each poll: the header (lane 0),
  // every entry (lane j < K: entry j) and the lane's vectors of [first, first
  // + 32 x kRecordBatch) of the row (as ll_fan_copy takes them; the sender
  // stores the row right after the record, so a record that is there costs
  // one round trip and its row no second one). Returns the header's count n
  // (0 after a timeout); lane j < n gets entry j; where n > 0 `batch` holds
  // the vectors (a row is sent only to a member with entries: n = 0 waits for
  // no row).
  __device__ __forceinline__ int load_record(const int4* line, int K, const int4* line_row,
                                             uint64_t first, uint64_t end, int peer, int lane,
                                             uint2* entry, int4 (&batch)[kRecordBatch]) {
    unsigned missing = 0;  // bit u: batch[u] not here yet
#pragma unroll
    for (int u = 0; u < kRecordBatch; ++u) {
      batch[u] = make_int4(0, 0, 0, 0);
      if (first + static_cast<uint64_t>(u * 32 + lane) < end) missing |= 1u << u;
    }
    int n = -1;  // the header's count, once the header and its entries are here
    uint64_t start = 0;
    for (uint32_t spins = 0; !failed; ++spins) {
      // Every load of the poll is issued before any is looked at.
      uint4 head = make_uint4(0, 0, 0, 0), mine = make_uint4(0, 0, 0, 0);
      uint4 lo[kRecordBatch], hi[kRecordBatch];
      if (n < 0 && lane == 0) head = load_line(line);
      if (n < 0 && lane < K) mine = load_line(line + 1 + lane);
#pragma unroll
      for (int u = 0; u < kRecordBatch; ++u) {
        if ((missing >> u) & 1u) {
          const int4* p = line_row + 2 * (first + static_cast<uint64_t>(u * 32 + lane));
          lo[u] = load_line(p);
          hi[u] = load_line(p + 1);
        }
      }
      uint32_t seen = flag;
      if (n < 0) {
        const bool here = __shfl_sync(kFullMask, head.y == flag && head.w == flag, 0);
        const unsigned entries =
            __ballot_sync(kFullMask, lane < K && mine.y == flag && mine.w == flag);
        if (here) {
          const int count = min(static_cast<int>(__shfl_sync(kFullMask, head.x, 0)), K);
          const unsigned need = count >= 32 ? kFullMask : (1u << count) - 1u;
          if ((entries & need) == need) {
            n = count;
            *entry = make_uint2(mine.x, mine.z);
          }
        }
        if (n < 0) seen = head.y != flag ? head.y : mine.y;
      }
      if (n == 0) return 0;
#pragma unroll
      for (int u = 0; u < kRecordBatch; ++u) {
        if (((missing >> u) & 1u) && row_vector(lo[u], hi[u], &batch[u], &seen)) {
          missing &= ~(1u << u);
        }
      }
      if (n > 0 && !__any_sync(kFullMask, missing != 0)) return n;
      if ((spins & 255u) == 255u) {
        int gave_up = 0;
        if (lane == 0) {
          give_up_after_timeout(start, peer, seen, kDeviceErrorLineTimeout);
          gave_up = failed ? 1 : 0;
        }
        failed = __shfl_sync(kFullMask, gave_up, 0) != 0;
      }
    }
    return 0;
  }
};

// fan_copy from a line row of one sender: each row vector is polled once and
// stored to every destination of `dst_lanes` (plain rows). `batch` holds the
// first vectors, loaded by RoundPoll::load_record.
__device__ __forceinline__ void ll_fan_copy(RoundPoll& poll, const int4* line_row, int peer,
                                            int4* dst, unsigned dst_lanes, uint64_t first,
                                            uint64_t end, int lane,
                                            const int4 (&batch)[kRecordBatch]) {
  for (uint64_t base = first; base < end; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = base + static_cast<uint64_t>(u * 32 + lane);
      if (base == first && u < kRecordBatch) {
        v[u] = batch[u];
      } else {
        v[u] = i < end ? poll.load_vector(line_row, i, peer) : make_int4(0, 0, 0, 0);
      }
    }
    for (unsigned m = dst_lanes; m != 0; m &= m - 1) {
      const int from = __ffs(static_cast<int>(m)) - 1;
      auto* d = reinterpret_cast<int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(dst), from));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t i = base + static_cast<uint64_t>(u * 32 + lane);
        if (i < end) device::store_stream(d + i, v[u]);
      }
    }
  }
}

// Vectors [base, base + 32 x kUnroll) of a row, lane's share, read-only path.
__device__ __forceinline__ void load_batch(const int4* src, uint64_t base, uint64_t end, int lane,
                                           int4 (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint64_t i = base + static_cast<uint64_t>(u * 32 + lane);
    v[u] = i < end ? device::load_stream(src + i) : make_int4(0, 0, 0, 0);
  }
}

// fan_copy to two kinds of destination: plain rows (each lane of
// `dst_lanes`: its `dst`) and line rows flagged `flag` (each lane of
// `line_lanes`: its `line_dst`). Each source vector is loaded once; `batch`
// holds the first batch, loaded by load_batch before the call, so that a
// caller's other work overlaps those loads.
__device__ __forceinline__ void fan_copy_to_lines(const int4* src, int4* dst, unsigned dst_lanes,
                                                  int4* line_dst, unsigned line_lanes,
                                                  uint32_t flag, uint64_t first, uint64_t end,
                                                  int lane, const int4 (&batch)[kUnroll]) {
  for (uint64_t base = first; base < end; base += 32 * kUnroll) {
    int4 v[kUnroll];
    if (base == first) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = batch[u];
    } else {
      load_batch(src, base, end, lane, v);
    }
    for (unsigned m = line_lanes; m != 0; m &= m - 1) {  // the NVLink stores first
      const int from = __ffs(static_cast<int>(m)) - 1;
      auto* d = reinterpret_cast<int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(line_dst), from));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t i = base + static_cast<uint64_t>(u * 32 + lane);
        if (i < end) ll_store_vector(d, i, v[u], flag);
      }
    }
    for (unsigned m = dst_lanes; m != 0; m &= m - 1) {
      const int from = __ffs(static_cast<int>(m)) - 1;
      auto* d = reinterpret_cast<int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(dst), from));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t i = base + static_cast<uint64_t>(u * 32 + lane);
        if (i < end) device::store_stream(d + i, v[u]);
      }
    }
  }
}

// acc[0..7] += w * the 8 bf16 values of `packed`.
__device__ __forceinline__ void add_weighted(float* acc, const int4& packed, float w) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] += w * f.x;
    acc[2 * j + 1] += w * f.y;
  }
}

__device__ __forceinline__ int4 pack_bf16(const float* acc) {
  int4 packed;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  return packed;
}

// One warp writes to `dst` vectors [first, end) of the fp32 sum of
//   weight_i * row_i  for the lanes i in `weighted_lanes` (each lane's `row`
//                     and `weight`; rows written by earlier kernels: read-only path)
// + row_j            for the lanes j in `plain_lanes` (each lane's `plain`;
//                     rows a peer wrote during this kernel: load_peer)
// rounded to bf16 once. Every lane must call it with the same lane masks.
// kLinesIn: the plain rows are line rows, lane j's written by member j, polled
// through `poll`. kLineOut: `dst` is a line row, flagged with poll's flag.
template <bool kLinesIn = false, bool kLineOut = false>
__device__ __forceinline__ void weighted_sum(int4* dst, const int4* row, float weight,
                                             unsigned weighted_lanes, const int4* plain,
                                             unsigned plain_lanes, uint64_t first, uint64_t end,
                                             int lane, RoundPoll* poll = nullptr) {
  for (uint64_t base = first; base < end; base += 32 * kUnroll) {
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
    }
    // Two rows at a time, so that each lane has 2 x kUnroll loads in flight.
    for (unsigned m = weighted_lanes; m != 0;) {
      const int from_a = __ffs(static_cast<int>(m)) - 1;
      m &= m - 1;
      const int from_b = m != 0 ? __ffs(static_cast<int>(m)) - 1 : from_a;
      const bool two = m != 0;
      if (two) m &= m - 1;
      const auto* ra = reinterpret_cast<const int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), from_a));
      const auto* rb = reinterpret_cast<const int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), from_b));
      const float wa = __shfl_sync(kFullMask, weight, from_a);
      const float wb = two ? __shfl_sync(kFullMask, weight, from_b) : 0.f;
      int4 va[kUnroll], vb[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t i = base + static_cast<uint64_t>(u * 32 + lane);
        va[u] = i < end ? device::load_stream(ra + i) : make_int4(0, 0, 0, 0);
        vb[u] = two && i < end ? device::load_stream(rb + i) : make_int4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        add_weighted(acc[u], va[u], wa);
        add_weighted(acc[u], vb[u], wb);
      }
    }
    for (unsigned m = plain_lanes; m != 0; m &= m - 1) {
      const int from = __ffs(static_cast<int>(m)) - 1;
      const auto* r = reinterpret_cast<const int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(plain), from));
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t i = base + static_cast<uint64_t>(u * 32 + lane);
        if constexpr (kLinesIn) {
          v[u] = i < end ? poll->load_vector(r, i, from) : make_int4(0, 0, 0, 0);
        } else {
          v[u] = i < end ? load_peer(r + i) : make_int4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) add_weighted(acc[u], v[u], 1.f);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = base + static_cast<uint64_t>(u * 32 + lane);
      if (i < end) {
        if constexpr (kLineOut) {
          ll_store_vector(dst, i, pack_bf16(acc[u]), poll->flag);
        } else {
          device::store_stream(dst + i, pack_bf16(acc[u]));
        }
      }
    }
  }
}

// Where things are in member `m`'s data area.
struct Layout {
  const MoeKernelArgs* a;
  __device__ uint8_t* base(int m) const { return a->team.data[m]; }
  __device__ uint64_t row_bytes() const { return static_cast<uint64_t>(a->hidden) * 2; }
  // recv_x row of (local expert le, source s, slot) on member m
  __device__ int4* recv_row(int m, int le, int s, int slot) const {
    const uint64_t row = (static_cast<uint64_t>(le) * a->team.size + s) * a->max_tokens + slot;
    return reinterpret_cast<int4*>(base(m) + a->recv_x_offset + row * row_bytes());
  }
  __device__ int32_t* recv_src(int m, int le, int s, int slot) const {
    const uint64_t row = (static_cast<uint64_t>(le) * a->team.size + s) * a->max_tokens + slot;
    return reinterpret_cast<int32_t*>(base(m) + a->recv_src_offset) + row;
  }
  // token t of source s as staged on member m
  __device__ int4* stage_row(int m, int s, int t) const {
    const uint64_t row = static_cast<uint64_t>(s) * a->max_tokens + t;
    return reinterpret_cast<int4*>(base(m) + a->stage_offset + row * row_bytes());
  }
  // header of token t of source s on member m, for rounds of `parity`; entries follow it
  __device__ int4* meta(int m, int parity, int s, int t) const {
    const uint64_t rec = (static_cast<uint64_t>(parity) * a->team.size + s) * a->max_tokens +
                         static_cast<uint64_t>(t);
    return reinterpret_cast<int4*>(base(m) + a->meta_offset) + rec * (1 + a->top_k);
  }
  // groups of 32 row vectors: each carries a flag of its own
  __device__ int groups() const { return (a->hidden / 8 + 31) / 32; }
  // flags of token t of source s's groups on member m, for rounds of `parity`
  __device__ uint32_t* flags(int m, int parity, int s, int t) const {
    const uint64_t row = (static_cast<uint64_t>(parity) * a->team.size + s) * a->max_tokens +
                         static_cast<uint64_t>(t);
    return reinterpret_cast<uint32_t*>(base(m) + a->flags_offset) + row * groups();
  }
  // flags of member d's partial row for token t's groups, on member m (the source)
  __device__ uint32_t* partial_flags(int m, int d, int t) const {
    const uint64_t row = static_cast<uint64_t>(d) * a->max_tokens + static_cast<uint64_t>(t);
    return reinterpret_cast<uint32_t*>(base(m) + a->partial_flags_offset) + row * groups();
  }
  // Low-latency line of token t of source s on member m, for rounds of `parity`:
  // 1 + K meta vectors, then the row (2 line vectors per row vector).
  __device__ uint64_t line_vectors() const {
    return 1 + static_cast<uint64_t>(a->top_k) + 2 * (static_cast<uint64_t>(a->hidden) / 8);
  }
  __device__ int4* line(int m, int parity, int s, int t) const {
    const uint64_t at = (static_cast<uint64_t>(parity) * a->team.size + s) * a->ll_tokens + t;
    return reinterpret_cast<int4*>(base(m) + a->ll_offset) + at * line_vectors();
  }
  __device__ int4* line_row(int m, int parity, int s, int t) const {
    return line(m, parity, s, t) + 1 + a->top_k;
  }
  // member d's low-latency partial row for token t, on member m (the source)
  __device__ int4* line_partial(int m, int d, int t) const {
    const uint64_t at = static_cast<uint64_t>(d) * a->ll_tokens + t;
    return reinterpret_cast<int4*>(base(m) + a->ll_partial_offset) +
           at * 2 * (static_cast<uint64_t>(a->hidden) / 8);
  }
  // member d's partial sum for token t, on member m (the token's source)
  __device__ int4* partial_row(int m, int d, int t) const {
    const uint64_t row = static_cast<uint64_t>(d) * a->max_tokens + t;
    return reinterpret_cast<int4*>(base(m) + a->partial_offset + row * row_bytes());
  }
};

}  // namespace ferry::symmetric::moe
