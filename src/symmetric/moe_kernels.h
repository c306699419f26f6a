// The dispatch and combine kernels of MoeExchange (moe_dispatch.cu,
// moe_combine.cu) and what they take. CUDA C++17: no ferry/status.h here.
//
// Layout of every member's symmetric data area (offsets in MoeKernelArgs; E
// local experts, W members, T max tokens, H hidden, K top-k, G = ceil(H / 256)
// groups of 32 row vectors):
//   recv_x   bf16  [E][W * T][H]  rows of (local expert, source), arrival order
//   recv_src int32 [E][W * T]     each row's token index at its source
//   stage    bf16  [W][T][H]      token t of source s, sent once per member
//   meta     int4  [2][W][T][1 + K]  token t of source s: a header {round, n,
//                                 0, 0} and n entries {local expert, slot,
//                                 weight bits, 0}; two sets by round parity
//   flags    u32   [2][W][T][G]   dispatch: group g of token t of source s (and,
//                                 for g = 0, its meta record) is there when
//                                 its flag is the round; two sets by parity
//   partial  bf16  [W][T][H]      combine: member d's weighted sum for token t
//   partial_flags u32 [W][T][G]   combine: group g of member d's partial row of
//                                 token t is there when its flag is the round
//   ll       int4  [2][W][L][1 + K + 2H/8]  low-latency lines (below) of token t
//                                 of source s, two sets by dispatch round parity
//   ll_partial int4 [W][L][2H/8]  combine's low-latency partial rows from member d
// Signal slots: [2][W] dispatch (parity, source; value round << 32 | tokens,
// bit 31 of tokens: low-latency). It is sent first and says only how many
// tokens come: every group of rows carries its own flag (above), so that a
// receiver copies each group as it lands, with no grid-wide wait on either side.
//
// Why two sets where there are two: a member can be one round ahead of another
// (its dispatch waits for every other member's tokens of that round, so never
// two). Stage and partial rows need one set: a member writes a peer's stage
// rows again only after its combine saw that peer's partial rows of the
// tokens concerned, which that peer wrote after it had read the stage rows.
//
// Low latency (a member's call of at most L = min(T, kLowLatencyTokens)
// tokens): every 16-byte store carries its own completion flag (the round), as
// NCCL's LL protocol does -- {4 bytes of data, flag, 4 bytes, flag}, stored
// and loaded 16 bytes at once, each 8-byte half atomic -- so the receiver polls
// the data itself and no fence or flag store stands between the stores and
// their reader. Half of each store is flag: for tiny calls latency, not bytes,
// is the cost.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "ferry/device_team.h"

namespace ferry::symmetric {

struct MoeKernelArgs {
  DeviceTeam team;
  int num_tokens;  // this member's tokens of this round
  int hidden;      // bf16 values per row
  int top_k;
  int experts_per_rank;
  int max_tokens;
  uint64_t recv_x_offset;  // in every member's data area
  uint64_t recv_src_offset;
  uint64_t stage_offset;
  uint64_t meta_offset;
  uint64_t flags_offset;
  uint64_t partial_offset;
  uint64_t partial_flags_offset;
  uint64_t ll_offset;
  uint64_t ll_partial_offset;
  int ll_tokens;           // L: calls of at most this many tokens use low-latency lines
  uint32_t dispatch_slot;  // first of 2 x size dispatch slots
  uint64_t round;          // 1, 2, ...: the dispatch's number; its combine has the same
  // Workspace, local to this member.
  int32_t* slot_counter;        // [size * experts_per_rank], zero between calls
  unsigned long long* slot_of;  // [max_tokens * top_k]: round << 32 | slot, for split rows
  int32_t* recv_count;          // [experts_per_rank * size]
  uint32_t* counts_zeroed;      // the round, once recv_count's other sources' columns are zero
  int32_t* tokens_from;         // [size]: each source's tokens in the last dispatch
  uint32_t* remote_members;     // [max_tokens]: bit d: token t has experts on member d != me
  unsigned int* units_done;     // zero between calls; the last unit's warp resets it
  // dispatch
  const void* x;
  const int64_t* topk_idx;
  const float* topk_weights;
  // combine
  const void* y;
  void* out;
};

cudaError_t launch_dispatch(const MoeKernelArgs& args, int blocks, cudaStream_t stream);
cudaError_t launch_combine(const MoeKernelArgs& args, int blocks, cudaStream_t stream);
constexpr int kMoeThreadsPerBlock = 512;
constexpr int kLowLatencyTokens = 8;
// Low-latency calls launch at most this many blocks: enough warps to split a
// few rows finely, fewer to start and to finish.
constexpr int kLowLatencyBlocks = 8;
// Load the kernels now (see preload_kernels in symmetric_kernels.h).
cudaError_t preload_dispatch_kernel();
cudaError_t preload_combine_kernel();
cudaError_t preload_moe_kernels();  // both

}  // namespace ferry::symmetric
