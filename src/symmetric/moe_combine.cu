// MoE combine as one kernel: each member returns one row per token it served,
// the weighted sum of its own experts' outputs for that token, not one row
// per expert.
//
//  1. expert side: warps take (source, token, chunk). The meta record the
//     dispatch left for (source, token) names this member's rows of the
//     token and their weights; the warp reads each once, sums weight x row in
//     fp32 and stores the sum, rounded to bf16, into the source's partial row
//     for (this member, token) over NVLink; after a fence, the flag of each
//     group of 32 vectors it wrote.
//  2. source side: warps take (token, chunk) of this member's tokens, wait for
//     the flags of the members the token chose (acquire), and write
//       out = sum of weight x row over this member's own experts (read in
//             place from y) + the other members' partial rows
//     accumulated in fp32, rounded to bf16 once. Every row is read once, as
//     soon as its groups land: no member waits for another's whole call.
// Low latency (a source's call of at most ll_tokens tokens, moe_kernels.h):
// the partial rows for that source travel in flagged lines, which the source
// polls.
#include "symmetric/moe_device.cuh"

namespace ferry::symmetric {
namespace {

using moe::kFullMask;

__global__ void __launch_bounds__(kMoeThreadsPerBlock, 1) combine_kernel(MoeKernelArgs a) {
  const DeviceTeam& team = a.team;
  const moe::Grid g = moe::grid();
  const moe::Layout at{&a};
  const int lane = g.lane;
  const int W = team.size, E = a.experts_per_rank, K = a.top_k, me = team.rank;
  const uint64_t row_vectors = static_cast<uint64_t>(a.hidden) / 8;
  const auto* y = static_cast<const int4*>(a.y);
  const uint32_t round32 = static_cast<uint32_t>(a.round);
  const int parity = static_cast<int>(a.round & 1);
  auto y_row = [&](int le, int s, int slot) {
    return y + ((static_cast<uint64_t>(le) * W + s) * a.max_tokens + slot) * row_vectors;
  };
  // Lane j < n holds entry j of a meta record: its row in y and its weight.
  // The header and the entries come in one load (lane 0: header, lane 1 + j:
  // entry j; top-32's last entry separately).
  auto load_entries = [&](const int4* rec, int s, const int4** row, float* weight) -> unsigned {
    const int4 mine = lane <= K ? moe::load_peer(rec + lane) : make_int4(0, 0, 0, 0);
    const int tag = __shfl_sync(kFullMask, mine.x, 0);
    const int count = __shfl_sync(kFullMask, mine.y, 0);
    if (static_cast<uint32_t>(tag) != round32) return 0u;  // no choice of this token here
    int4 entry;
    entry.x = __shfl_down_sync(kFullMask, mine.x, 1);
    entry.y = __shfl_down_sync(kFullMask, mine.y, 1);
    entry.z = __shfl_down_sync(kFullMask, mine.z, 1);
    const int n = count < K ? count : K;
    if (lane == 31 && n == 32) entry = moe::load_peer(rec + 32);
    *row = nullptr;
    *weight = 0.f;
    if (lane < n) {
      if (entry.x >= 0 && entry.x < E && entry.y >= 0 && entry.y < a.max_tokens) {
        *row = y_row(entry.x, s, entry.y);
        *weight = __int_as_float(entry.z);
      }
    }
    return __ballot_sync(kFullMask, *row != nullptr);
  };

  // 1. expert side: one partial row per (source, token) this member served.
  int total_tokens = 0;
  for (int i = 1; i < W; ++i) total_tokens += a.tokens_from[(me + i) % W];
  moe::RoundPoll poll(team, round32);
  const int chunks = moe::chunks_per_row(row_vectors, total_tokens, g.warps);
  const unsigned units = static_cast<unsigned>(total_tokens * chunks);
  for (unsigned w = static_cast<unsigned>(g.warp); w < units; w += static_cast<unsigned>(g.warps)) {
    // Unit w -> (source s, token t, chunk c), the sources one after the other.
    int t = static_cast<int>(w / static_cast<unsigned>(chunks));
    const int c = static_cast<int>(w % static_cast<unsigned>(chunks));
    int s = me;
    for (int i = 1; i < W; ++i) {
      s = (me + i) % W;
      if (t < a.tokens_from[s]) break;
      t -= a.tokens_from[s];
    }
    const int4* row = nullptr;
    float weight = 0.f;
    const unsigned lanes = load_entries(at.meta(me, parity, s, t), s, &row, &weight);
    if (lanes == 0) continue;
    uint64_t first = 0, end = 0;
    moe::chunk_range(row_vectors, chunks, c, &first, &end);
    if (a.tokens_from[s] <= a.ll_tokens) {
      moe::weighted_sum<false, true>(at.line_partial(s, me, t), row, weight, lanes, nullptr, 0u,
                                     first, end, lane, &poll);
      continue;
    }
    moe::weighted_sum(at.partial_row(s, me, t), row, weight, lanes, nullptr, 0u, first, end, lane);
    // The fence orders every lane's stores before the flags of their groups.
    __syncwarp();
    device::fence();
    uint32_t* flags = at.partial_flags(s, me, t);
    const uint32_t g1 = static_cast<uint32_t>((end + 31) / 32);
    for (uint32_t group = static_cast<uint32_t>(first / 32 + lane); group < g1; group += 32) {
      moe::store_flag(flags + group, round32);
    }
  }

  // 2. source side: this member's tokens.
  auto* out = static_cast<int4*>(a.out);
  const int out_chunks = moe::chunks_per_row(row_vectors, a.num_tokens, g.warps);
  const unsigned out_units = static_cast<unsigned>(a.num_tokens * out_chunks);
  // A low-latency call whose expert-side units leave room sums on the warps
  // after them, which poll from the kernel's start instead of after step 1.
  const unsigned out_base =
      a.num_tokens <= a.ll_tokens && units + out_units <= static_cast<unsigned>(g.warps) ? units
                                                                                         : 0u;
  // Warps below out_base wrap to a w past out_units: they take no unit here.
  for (unsigned w = static_cast<unsigned>(g.warp) - out_base; w < out_units;
       w += static_cast<unsigned>(g.warps)) {
    const int t = static_cast<int>(w / static_cast<unsigned>(out_chunks));
    const int c = static_cast<int>(w % static_cast<unsigned>(out_chunks));
    const unsigned remote = a.remote_members[t];
    // This member's own rows first: their loads need no flag.
    const int4* row = nullptr;
    float weight = 0.f;
    const unsigned own_lanes = load_entries(at.meta(me, parity, me, t), me, &row, &weight);
    const bool mine = lane < W && lane != me && ((remote >> lane) & 1u) != 0;
    uint64_t first = 0, end = 0;
    moe::chunk_range(row_vectors, out_chunks, c, &first, &end);
    if (a.num_tokens <= a.ll_tokens) {  // lines: polled as they come
      const int4* partial = mine ? at.line_partial(me, lane, t) : nullptr;
      moe::weighted_sum<true, false>(out + static_cast<uint64_t>(t) * row_vectors, row, weight,
                                     own_lanes, partial, __ballot_sync(kFullMask, mine), first, end,
                                     lane, &poll);
      continue;
    }
    // The flags of every group of the chunk from every member the token
    // chose, all at once: lane k waits for pairs k, k + 32, ... of (member,
    // group) (acquire); __syncwarp then orders every lane's loads of the
    // partial rows after them.
    const uint32_t g0 = static_cast<uint32_t>(first / 32);
    const uint32_t groups = static_cast<uint32_t>((end + 31) / 32) - g0;
    const uint32_t waits = static_cast<uint32_t>(__popc(remote)) * groups;
    for (uint32_t k = static_cast<uint32_t>(lane); k < waits; k += 32) {
      unsigned m = remote;  // the (k / groups)-th member of `remote`
      for (uint32_t skip = k / groups; skip > 0; --skip) m &= m - 1;
      const int d = __ffs(static_cast<int>(m)) - 1;
      if (!poll.wait_flag(at.partial_flags(me, d, t) + g0 + k % groups, d)) break;
    }
    // A lane that timed out gives the whole warp up: later polls return at once.
    poll.failed = __any_sync(kFullMask, poll.failed);
    __syncwarp();
    const int4* partial = mine ? at.partial_row(me, lane, t) : nullptr;
    const unsigned partial_lanes = __ballot_sync(kFullMask, mine);
    moe::weighted_sum(out + static_cast<uint64_t>(t) * row_vectors, row, weight, own_lanes, partial,
                      partial_lanes, first, end, lane);
  }
}

}  // namespace

cudaError_t launch_combine(const MoeKernelArgs& args, int blocks, cudaStream_t stream) {
  combine_kernel<<<blocks, kMoeThreadsPerBlock, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t preload_combine_kernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, combine_kernel);
}

cudaError_t preload_moe_kernels() {
  if (cudaError_t e = preload_dispatch_kernel(); e != cudaSuccess) return e;
  return preload_combine_kernel();
}

}  // namespace ferry::symmetric
