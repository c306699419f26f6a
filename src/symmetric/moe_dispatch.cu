// MoE dispatch as one kernel: each token crosses NVLink once per member that
// holds any of its experts, not once per expert.
//
//  0. a warp tells every other member how many tokens come (a relaxed store:
//     it orders no data) and zeroes this member's counts of rows from others.
//  1. send: warps take (token, chunk of its row). Each (token, k) choice gets
//     its slot in the expert's receive block from this member's counter for
//     that expert. The warp writes, for each other member, the token's meta
//     record there: a header {round, n} and n entries {local expert, slot,
//     weight} (n = 0 where the token chose none of its experts); loads the
//     chunk once and stores it into recv_x of each of this member's own chosen
//     experts and the stage row (source = me, token) of each other member it
//     chose; then a fence and, per other member, the flag of each group of 32
//     vectors of the chunk (group 0 also covers the meta record), sent or not.
//  2. the warp that finishes the last unit (finish_unit) takes this member's
//     own experts' counts and resets the counters for the next call.
//  3. fan out: warps take (source, token, chunk); each waits for the flags of
//     group 0 and of its groups at once (a lane each, acquire), reads the meta
//     record with the chunk's first vectors, copies the staged rows into this
//     member's experts' recv_x rows (local HBM, one read per row, one write per
//     expert) and counts them. A group is copied as soon as it lands: no
//     member waits for another's whole call.
// Meta records and flags come in two sets by round parity: a member can be
// one dispatch ahead of another, never two (moe_kernels.h says why).
//
// A low-latency call (at most ll_tokens tokens, moe_kernels.h) says so in its
// signal; its rows and meta records travel in flagged lines, slots are worked
// out by prefix counts instead of counters, and no unit waits for another.
// The receiver polls the lines themselves, counts each expert's rows from
// their meta records and copies each row to its experts as its vectors arrive.
#include "symmetric/moe_device.cuh"

namespace ferry::symmetric {
namespace {

using moe::kFullMask;

__device__ __forceinline__ unsigned long long load_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// The slot of (token, k) when several warps copy chunks of the token's row:
// the first one claims it (CAS on a word tagged with this call's round), takes
// the next slot of the expert and publishes it; the others wait for it.
__device__ int claim_slot(unsigned long long* word, uint64_t round, int* counter) {
  const unsigned long long busy = (static_cast<unsigned long long>(round) << 32) | 0xffffffffull;
  for (;;) {
    const unsigned long long v = load_acquire_gpu(word);
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

// Small calls split rows over many warps; there every warp of a token works
// out its choices' slots itself instead of claiming them: the slot of choice
// (t, k) is the number of earlier choices (in token, then k order) of the same
// expert. Every lane calls it; lane k < top_k gets the slot of its `e` (-1:
// none). Cost: (t x top_k) / 32 loads per lane, so only for few tokens.
constexpr int kPrefixSlotTokens = 64;

__device__ int prefix_slot(const int64_t* topk_idx, int t, int K, int64_t e, int lane) {
  int count = 0;
  const int prior = t * K;
  for (int base = 0; base < prior; base += 32) {
    const int i = base + lane;
    const int64_t v = i < prior ? topk_idx[i] : -1;
    for (int k = 0; k < K; ++k) {
      const int64_t ek = __shfl_sync(kFullMask, e, k);
      const unsigned same = __ballot_sync(kFullMask, ek >= 0 && v == ek);
      if (lane == k) count += __popc(same);
    }
  }
  for (int k = 0; k < K; ++k) {  // earlier choices of this token
    const int64_t ek = __shfl_sync(kFullMask, e, k);
    if (k < lane && e >= 0 && ek == e) ++count;
  }
  return e >= 0 ? count : -1;
}

// In the dispatch signal's token field: this call's rows come in lines.
constexpr uint64_t kLinesFlag = 1ull << 31;

// Step 2, by the warp that finished the last send unit: this member's own
// experts' counts, and every counter back to zero for the next call.
// finish_unit ordered every unit's atomics before this warp.
__device__ void keep_own_counts(const MoeKernelArgs& a, int lane) {
  const int W = a.team.size, E = a.experts_per_rank, me = a.team.rank;
  for (int e = lane; e < W * E; e += 32) {
    int count = atomicExch(&a.slot_counter[e], 0);
    if (count > a.max_tokens) count = a.max_tokens;  // the overflow was recorded in step 1
    if (e / E == me) a.recv_count[(e % E) * W + me] = count;
  }
}

// Step 0, by the signalling warp: the columns of recv_count that other
// members' rows fill (by atomics as they land) start at zero; counts_zeroed
// says so (the round).
__device__ void zero_received_counts(const MoeKernelArgs& a, int lane) {
  const int W = a.team.size, E = a.experts_per_rank, me = a.team.rank;
  for (int i = lane; i < W * E; i += 32) {
    if (i % W != me) a.recv_count[i] = 0;
  }
  __syncwarp();
  __threadfence();
  if (lane == 0) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(a.counts_zeroed),
                 "r"(static_cast<uint32_t>(a.round))
                 : "memory");
  }
}

// Waits (lane 0, acquire at GPU scope) until zero_received_counts has run in
// this call; every lane's later atomics on recv_count come after it.
__device__ void wait_counts_zeroed(const MoeKernelArgs& a, int lane) {
  if (lane == 0) {
    const uint32_t round32 = static_cast<uint32_t>(a.round);
    uint32_t v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];"
                   : "=r"(v)
                   : "l"(a.counts_zeroed)
                   : "memory");
    } while (v != round32);
  }
  __syncwarp();
}

// Lane l's count, for the local experts l0 + l of a window of 32, of the
// lanes' `le` equal to it (-1: none), added over calls. Every lane calls it.
__device__ __forceinline__ void count_window(int le, int l0, int E, int lane, int* count) {
  for (int l = 0; l < 32 && l0 + l < E; ++l) {
    const int n = __popc(__ballot_sync(kFullMask, le == l0 + l));
    if (lane == l) *count += n;
  }
}

// Step 0, by one warp: the signal to every other member, first thing and
// with no fence: it says only how many tokens come and whether in lines (the
// lines and the staged groups carry their own flags). A relaxed store, not a
// release: a release at system scope would first wait for this SM's earlier
// stores.
__device__ void send_token_signals(const MoeKernelArgs& a, bool lines, int lane) {
  const DeviceTeam& team = a.team;
  const int W = team.size, me = team.rank;
  const int parity = static_cast<int>(a.round & 1);
  const uint64_t value =
      (a.round << 32) | static_cast<uint32_t>(a.num_tokens) | (lines ? kLinesFlag : 0);
  for (int d = lane; d < W; d += 32) {
    if (d != me) {
      uint64_t* slot = team.signals[d] + a.dispatch_slot + static_cast<uint32_t>(parity * W + me);
      asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(slot), "l"(value) : "memory");
    }
  }
}

// Low latency, by the same warp: this member's own experts' counts from
// topk_idx, by ballots (no atomics, no wait for any unit).
__device__ void count_own_rows(const MoeKernelArgs& a, int lane) {
  const int W = a.team.size, E = a.experts_per_rank, K = a.top_k, me = a.team.rank;
  const int choices = a.num_tokens * K;
  const int64_t first = static_cast<int64_t>(me) * E;
  for (int l0 = 0; l0 < E; l0 += 32) {
    int count = 0;
    for (int base = 0; base < choices; base += 32) {
      const int i = base + lane;
      const int64_t e = i < choices ? a.topk_idx[i] : -1;
      count_window(e >= first && e < first + E ? static_cast<int>(e - first) : -1, l0, E, lane,
                   &count);
    }
    // More than max_tokens: the overflow is recorded by a send unit.
    if (l0 + lane < E) a.recv_count[(l0 + lane) * W + me] = min(count, a.max_tokens);
  }
}

// Low latency, by one warp per source: how many rows of each local expert
// source s sent, counted from its lines -- every token's header and the first
// 32 entries in one poll (RoundPoll::load_headers), later entries one by one.
__device__ void receive_line_counts(const MoeKernelArgs& a, const moe::Layout& at,
                                    moe::RoundPoll& poll, int s, int tokens, int lane) {
  const int W = a.team.size, E = a.experts_per_rank, K = a.top_k, me = a.team.rank;
  const int parity = static_cast<int>(a.round & 1);
  wait_counts_zeroed(a, lane);  // its column is written here, after the zeroing
  const int4* line0 = at.line(me, parity, s, 0);
  const uint64_t stride = at.line_vectors();
  int n = 0;          // lane t < tokens (<= kLowLatencyTokens < 32): token t's entries here
  uint2 first_entry;  // lane i: entry i of the first 32
  poll.load_headers(line0, stride, tokens, K, s, lane, &n, &first_entry);
  const int entries = tokens * K;
  for (int l0 = 0; l0 < E; l0 += 32) {
    int count = 0;
    for (int base = 0; base < entries; base += 32) {
      const int i = base + lane;
      const int t = i < entries ? i / K : 0, j = i % K;
      const int n_t = __shfl_sync(kFullMask, n, t);
      int le = -1;
      if (i < entries && j < n_t) {
        const uint2 entry = base == 0
                                ? first_entry
                                : poll.load(line0 + static_cast<uint64_t>(t) * stride + 1 + j, s);
        if (static_cast<int>(entry.x >> 16) < a.max_tokens)
          le = static_cast<int>(entry.x & 0xffffu);
      }
      count_window(le, l0, E, lane, &count);
    }
    if (l0 + lane < E) a.recv_count[(l0 + lane) * W + s] = min(count, a.max_tokens);
  }
}

// Low latency, receiving token t of source s (one warp per (token, chunk)):
// the meta record from its line (lane 0 the header, lane j entry j), kept
// here as a plain record for combine (chunk 0), and the row's vectors
// [first, end) copied to each of this member's experts it chose as they arrive.
__device__ void receive_line(const MoeKernelArgs& a, const moe::Layout& at, moe::RoundPoll& poll,
                             int s, int t, int c, int fan_chunks, uint64_t row_vectors, int lane) {
  const int me = a.team.rank, K = a.top_k, E = a.experts_per_rank;
  const int parity = static_cast<int>(a.round & 1);
  const int4* line = at.line(me, parity, s, t);
  const int4* line_row = at.line_row(me, parity, s, t);
  uint64_t first = 0, end = 0;
  moe::chunk_range(row_vectors, fan_chunks, c, &first, &end);
  // Entry j: {le | slot << 16, weight}; lane 31 also takes entry 31 of a top-32.
  // The record and the chunk's first vectors come in the same polls.
  uint2 entry = make_uint2(0xffffffffu, 0);
  int4 batch[moe::kRecordBatch];
  const int n = poll.load_record(line, K, line_row, first, end, s, lane, &entry, batch);
  if (n == 0) return;  // token t chose none of this member's experts
  if (lane >= n) entry = make_uint2(0xffffffffu, 0);
  int4* dst = nullptr;
  const int le = static_cast<int>(entry.x & 0xffffu), slot = static_cast<int>(entry.x >> 16);
  if (lane < n && le < E && slot < a.max_tokens) dst = at.recv_row(me, le, s, slot);
  if (c == 0) {
    int4* rec = at.meta(me, parity, s, t);
    if (lane < n) {
      rec[1 + lane] = make_int4(dst != nullptr ? le : -1, slot, static_cast<int>(entry.y), 0);
      if (dst != nullptr) *at.recv_src(me, le, s, slot) = t;
    }
    if (lane == 0) rec[0] = make_int4(static_cast<int>(poll.flag), n, 0, 0);
  }
  const unsigned dst_lanes = __ballot_sync(kFullMask, dst != nullptr);
  if (dst_lanes == 0) return;
  moe::ll_fan_copy(poll, line_row, s, dst, dst_lanes, first, end, lane, batch);
}

// Step 3 for a staged source, token t of source s, vectors of chunk c of
// fan_chunks (one warp): the flags of group 0 (the meta record) and of the
// chunk's groups, all at once (a lane each); then the meta record and the
// chunk's first vectors in one round trip; then the rows to each of this
// member's experts the token chose, and their count. Every group's flag comes
// to every member, chosen or not, so no lane waits for a flag never sent.
__device__ void receive_staged(const MoeKernelArgs& a, const moe::Layout& at, moe::RoundPoll& poll,
                               int s, int t, int c, int fan_chunks, uint64_t row_vectors,
                               int lane) {
  const int W = a.team.size, E = a.experts_per_rank, K = a.top_k, me = a.team.rank;
  const int parity = static_cast<int>(a.round & 1);
  const uint32_t* flags = at.flags(me, parity, s, t);
  uint64_t first = 0, end = 0;
  moe::chunk_range(row_vectors, fan_chunks, c, &first, &end);
  // Lane k waits for flags k, k + 32, ... of {group 0, groups [from, to)}
  // (acquire); __syncwarp then orders every lane's later loads after them.
  const uint32_t from = first / 32 > 0 ? static_cast<uint32_t>(first / 32) : 1u;
  const uint32_t to = static_cast<uint32_t>((end + 31) / 32);
  const uint32_t waits = 1 + (to > from ? to - from : 0);
  bool here = true;
  for (uint32_t k = static_cast<uint32_t>(lane); here && k < waits; k += 32) {
    here = poll.wait_flag(flags + (k == 0 ? 0 : from + k - 1), s);
  }
  // A lane that timed out gives the whole warp up: later polls return at once.
  if (!__all_sync(kFullMask, here)) {
    poll.failed = true;
    return;
  }
  __syncwarp();
  const int4* rec = at.meta(me, parity, s, t);
  const int4* stage = at.stage_row(me, s, t);
  // The header and the entries in one load (lane 0: header, lane 1 + j:
  // entry j), with the chunk's first vectors.
  const int4 mine = lane <= K ? moe::load_peer(rec + lane) : make_int4(0, 0, 0, 0);
  int4 batch[moe::kStagedBatch];
  moe::load_peer_batch(stage, first, end, lane, batch);
  const int tag = __shfl_sync(kFullMask, mine.x, 0);
  const int count = __shfl_sync(kFullMask, mine.y, 0);
  if (static_cast<uint32_t>(tag) != poll.flag) return;  // a flag without its record: not sent
  int entry_le = __shfl_down_sync(kFullMask, mine.x, 1);
  int entry_slot = __shfl_down_sync(kFullMask, mine.y, 1);
  const int n = count < K ? count : K;
  if (lane == 31 && n == 32) {  // top-32: the last entry is past the lanes
    const int4 e32 = moe::load_peer(rec + 32);
    entry_le = e32.x;
    entry_slot = e32.y;
  }
  int4* dst = nullptr;
  int le = -1, slot = -1;
  if (lane < n) {
    le = entry_le;
    slot = entry_slot;
    if (le >= 0 && le < E && slot >= 0 && slot < a.max_tokens) dst = at.recv_row(me, le, s, slot);
  }
  const unsigned dst_lanes = __ballot_sync(kFullMask, dst != nullptr);
  if (dst_lanes == 0) return;  // token t chose none of this member's experts
  moe::fan_copy<false, moe::kStagedBatch>(stage, dst, dst_lanes, first, end, lane, batch);
  if (c == 0) {
    if (dst != nullptr) *at.recv_src(me, le, s, slot) = t;
    wait_counts_zeroed(a, lane);
    if (dst != nullptr) atomicAdd(&a.recv_count[le * W + s], 1);
  }
}

__global__ void __launch_bounds__(kMoeThreadsPerBlock, 1) dispatch_kernel(MoeKernelArgs a) {
  const DeviceTeam& team = a.team;
  const moe::Grid g = moe::grid();
  const moe::Layout at{&a};
  const int lane = g.lane;
  const int W = team.size, E = a.experts_per_rank, K = a.top_k, me = team.rank;
  const int experts = W * E;
  const uint64_t row_vectors = static_cast<uint64_t>(a.hidden) / 8;  // 8 bf16 per int4
  const auto* x = static_cast<const int4*>(a.x);
  const uint32_t round32 = static_cast<uint32_t>(a.round);

  // 0. tell the others how many tokens come; zero the counts they fill.
  const bool lines = a.num_tokens <= a.ll_tokens;  // low latency
  const int parity = static_cast<int>(a.round & 1);
  // The last warp: the send units start at warp 0, and a 1-token call's are
  // the first few warps, whose meta records should leave first.
  if (g.warp == g.warps - 1) {
    send_token_signals(a, lines, lane);
    zero_received_counts(a, lane);
    if (lines) count_own_rows(a, lane);
  }

  // 1. send.
  const int chunks = moe::chunks_per_row(row_vectors, a.num_tokens, g.warps);
  const unsigned units = static_cast<unsigned>(a.num_tokens * chunks);
  const bool by_prefix = lines || (chunks > 1 && a.num_tokens <= kPrefixSlotTokens);
  bool last = false;
  for (unsigned w = static_cast<unsigned>(g.warp); w < units; w += static_cast<unsigned>(g.warps)) {
    const int t = static_cast<int>(w) / chunks, c = static_cast<int>(w) % chunks;
    uint64_t first = 0, end = 0;
    moe::chunk_range(row_vectors, chunks, c, &first, &end);
    const int4* row = x + static_cast<uint64_t>(t) * row_vectors;
    // Lines: the row's first vectors are loaded now, while the routing is worked out.
    int4 batch[moe::kUnroll];
    if (lines) moe::load_batch(row, first, end, lane, batch);
    // Lane k holds choice k: its expert, member, slot.
    int64_t e = -1;
    float weight = 0.f;
    if (lane < K) {
      e = a.topk_idx[static_cast<uint64_t>(t) * K + lane];
      weight = a.topk_weights[static_cast<uint64_t>(t) * K + lane];
      if (e >= experts) {
        if (c == 0) {
          device::record_error(team, kDeviceErrorBadPeer, static_cast<int>(e / E), 0,
                               static_cast<uint64_t>(experts), static_cast<uint64_t>(e));
        }
        e = -1;
      }
      if (e < 0) e = -1;
    }
    const int d = e >= 0 ? static_cast<int>(e) / E : -1;
    const int le = e >= 0 ? static_cast<int>(e) % E : -1;
    int slot = -1;
    if (by_prefix) {
      slot = prefix_slot(a.topk_idx, t, K, e, lane);
      if (!lines && e >= 0 && c == 0) atomicAdd(&a.slot_counter[e], 1);  // the count only
    } else if (e >= 0) {
      slot = chunks == 1 ? atomicAdd(&a.slot_counter[e], 1)
                         : claim_slot(&a.slot_of[static_cast<uint64_t>(t) * K + lane], a.round,
                                      &a.slot_counter[e]);
    }
    if (slot >= 0) {
      if (slot >= a.max_tokens) {  // one token chose this expert more than once, too often
        if (c == 0) {
          device::record_error(team, kDeviceErrorOutOfRange, d, 0, static_cast<uint64_t>(slot) + 1,
                               static_cast<uint64_t>(a.max_tokens));
        }
        slot = -1;
      }
    }
    __syncwarp();
    const bool valid = slot >= 0;
    const int dkey = valid ? d : -1 - lane;  // invalid lanes match nobody
    const unsigned same = __match_any_sync(kFullMask, dkey);
    const unsigned lt = (1u << lane) - 1u;
    const int j = __popc(same & lt);  // this choice's entry among its member's
    const int n = __popc(same);
    unsigned remote = valid && d != me ? 1u << d : 0u;  // the other members chosen
    for (int o = 16; o > 0; o >>= 1) remote |= __shfl_xor_sync(kFullMask, remote, o);
    // The meta records first: a receiver of lines reads them before the row.
    if (c == 0) {
      if (lane == 0) a.remote_members[t] = remote;
      if (valid && lines && d != me) {
        int4* line = at.line(d, parity, me, t);
        moe::ll_store(line + 1 + j, static_cast<uint32_t>(le) | (static_cast<uint32_t>(slot) << 16),
                      __float_as_uint(weight), round32);
        if (j == 0) moe::ll_store(line, static_cast<uint32_t>(n), 0u, round32);
      } else if (valid) {
        int4* rec = at.meta(d, parity, me, t);
        rec[1 + j] = make_int4(le, slot, __float_as_int(weight), 0);
        if (j == 0) rec[0] = make_int4(static_cast<int>(round32), n, 0, 0);
        if (d == me) *at.recv_src(me, le, me, slot) = t;
      }
      // Every other member learns of each token, chosen or not.
      if (lane < W && lane != me && ((remote >> lane) & 1u) == 0) {
        if (lines) {
          moe::ll_store(at.line(lane, parity, me, t), 0u, 0u, round32);
        } else {
          at.meta(lane, parity, me, t)[0] = make_int4(static_cast<int>(round32), 0, 0, 0);
        }
      }
    }
    // Destinations: own experts' rows here; one stage row (or line) per other member.
    int4* dst = nullptr;
    int4* line_dst = nullptr;
    if (valid && d == me) dst = at.recv_row(me, le, me, slot);
    if (valid && d != me && j == 0) {
      if (lines) {
        line_dst = at.line_row(d, parity, me, t);
      } else {
        dst = at.stage_row(d, me, t);
      }
    }
    const unsigned dst_lanes = __ballot_sync(kFullMask, dst != nullptr);
    const unsigned line_lanes = __ballot_sync(kFullMask, line_dst != nullptr);
    if (line_lanes != 0) {
      moe::fan_copy_to_lines(row, dst, dst_lanes, line_dst, line_lanes, round32, first, end, lane,
                             batch);
    } else if (dst_lanes != 0) {
      moe::fan_copy<true>(row, dst, dst_lanes, first, end, lane);
    }
    if (lines) continue;
    // Staged: the fence orders every lane's stores above before the flags;
    // then each other member gets the flags of the chunk's groups, whether or
    // not it was sent the row (group 0 also covers the meta record), so that
    // a receiver waits for all of its groups at once.
    if (remote != 0 || c == 0) {
      __syncwarp();
      device::fence();
    }
    const uint32_t g0 = static_cast<uint32_t>(first / 32),
                   g1 = static_cast<uint32_t>((end + 31) / 32);
    for (int m = 0; m < W; ++m) {
      if (m == me) continue;
      uint32_t* flags = at.flags(m, parity, me, t);
      for (uint32_t group = g0 + static_cast<uint32_t>(lane); group < g1; group += 32) {
        moe::store_flag(flags + group, round32);
      }
    }
    if (moe::finish_unit(a.units_done, units, lane)) last = true;
  }

  // 2. the last unit's warp: this member's own counts; the counters back to zero.
  if (last) keep_own_counts(a, lane);

  // 3. fan out every other member's rows, the members in turn from different
  // warps so that every warp has work whatever the counts.
  // Only as many warps as the rows this member expects (as many tokens from
  // each other member as it has itself) take part, so that few warps poll in
  // small calls; more rows than that are still all copied.
  const int expected_rows = (a.num_tokens > 0 ? a.num_tokens : 1) * (W > 1 ? W - 1 : 1);
  const int fan_chunks = moe::chunks_per_row(row_vectors, expected_rows, g.warps);
  const int64_t fan_units = static_cast<int64_t>(expected_rows) * fan_chunks;
  const int fan_warps = fan_units < g.warps ? static_cast<int>(fan_units) : g.warps;
  // A low-latency call whose send units leave room receives on the warps
  // after them (fan warp fw = warp - fan_base), which poll from the kernel's
  // start instead of after their own sends.
  const int fan_base = lines && static_cast<int>(units) + fan_warps + (W - 1) <= g.warps
                           ? static_cast<int>(units)
                           : 0;
  const int fw = g.warp - fan_base;
  // Each source's token count (and a low-latency source's counts) is kept by
  // a warp of its own where the grid has warps beyond the fan-out's, so that
  // no row waits for it.
  const int spare = g.warps - fan_base - fan_warps;
  for (int i = 1; i < W; ++i) {
    const int s = (me + i) % W;
    const int keeper = fan_base + (i - 1 < spare ? fan_warps + i - 1 : s % fan_warps);
    const bool fans = fw >= 0 && fw < fan_warps;
    if (!fans && g.warp != keeper) continue;
    // A relaxed poll: the signal orders no data (lines and groups carry flags).
    const uint32_t slot = a.dispatch_slot + static_cast<uint32_t>(parity * W + s);
    const uint64_t v = moe::warp_poll(team, slot, a.round << 32, lane);
    int tokens = static_cast<int>(v & 0x7fffffffull);
    if (tokens > a.max_tokens) tokens = a.max_tokens;
    const bool from_lines = (v & kLinesFlag) != 0;
    if (from_lines && tokens > a.ll_tokens) tokens = a.ll_tokens;
    moe::RoundPoll poll(team, round32);
    if (g.warp == keeper) {
      if (from_lines) receive_line_counts(a, at, poll, s, tokens, lane);
      if (lane == 0) a.tokens_from[s] = tokens;
    }
    if (!fans) continue;
    const unsigned s_units = static_cast<unsigned>(tokens * fan_chunks);
    const unsigned stride = static_cast<unsigned>(fan_warps);
    // Source i starts its units (i - 1) / (W - 1) of the way round the warps,
    // so that, when each source sends as many rows as expected, every warp
    // serves one source and no warp two in turn.
    const unsigned offset = static_cast<unsigned>((static_cast<uint64_t>(i - 1) * stride) /
                                                  static_cast<unsigned>(W - 1));
    const unsigned start = (static_cast<unsigned>(fw) + stride - offset) % stride;
    for (unsigned w = start; w < s_units; w += stride) {
      const int t = static_cast<int>(w) / fan_chunks, c = static_cast<int>(w) % fan_chunks;
      if (from_lines) {
        receive_line(a, at, poll, s, t, c, fan_chunks, row_vectors, lane);
      } else {
        receive_staged(a, at, poll, s, t, c, fan_chunks, row_vectors, lane);
      }
    }
  }
}

}  // namespace

cudaError_t launch_dispatch(const MoeKernelArgs& args, int blocks, cudaStream_t stream) {
  dispatch_kernel<<<blocks, kMoeThreadsPerBlock, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t preload_dispatch_kernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, dispatch_kernel);
}

}  // namespace ferry::symmetric
