// Low-latency MoE dispatch and combine over a symmetric group
// (include/ferry/symmetric.h), built on the device API (include/ferry/device.cuh).
//
// Every member holds `experts_per_rank` experts; global expert e lives on
// member e / experts_per_rank. Per call a member has up to `max_tokens` tokens
// of `hidden` bf16 values and routes each to `top_k` global experts
// (topk_idx: int64, -1 = no expert) with weights (topk_weights: float32).
//
//  dispatch: each token crosses NVLink once per member that holds any of its
//    experts (not once per expert), with the list of that member's experts it
//    chose and their weights; the receiving member copies it into each of
//    those experts' receive rows, recv_x[local expert][source member][slot]
//    [hidden] (slot: arrival order, not token order), and the token's index
//    into recv_src[...][slot]. recv_count()[local expert][source] (int32) has
//    the rows of each block. One kernel; returns when this member has every
//    row.
//  combine: the expert outputs y, laid out like recv_x, are summed where they
//    are: each member returns to each source one row per token it served, the
//    fp32 sum of weight x row over its experts the token chose, rounded to
//    bf16; the source adds those rows and its own experts' weighted rows in
//    fp32 into out[token][hidden] (bf16). The weights are the dispatch's.
//
// Calls alternate dispatch, combine, dispatch, ... on one stream per member
// (the combine of a round is what tells a member that its peers are done with
// its previous dispatch's data); each member makes the same calls. A
// SymmetricMemory carries one MoeExchange for its whole life.
//
// Calls of at most 8 tokens (a decode step's) take a low-latency path: rows and
// their routing travel in 16-byte stores that each carry a completion flag, so
// that no fence or separate signal stands between the data and its receiver.
// Such a call launches at most 8 blocks, which is also what it has to receive
// other members' rows: members whose calls differ widely in size stay correct
// but the small ones receive slowly.
#pragma once

#include <cstdint>
#include <memory>

#include "ferry/status.h"
#include "ferry/symmetric.h"

namespace ferry {

struct MoeConfig {
  int max_tokens = 0;        // tokens per member per call, at most
  int hidden = 0;            // bf16 values per token; a multiple of 8 (16-byte rows)
  int top_k = 0;             // experts per token, 1..32
  int experts_per_rank = 0;  // local experts per member
  int sm_count = 0;          // blocks the kernels use; 0: every SM of the GPU
};

// Where dispatch/combine keep their data in the symmetric buffer; create the
// SymmetricMemory with at least data_bytes and signal_slots.
struct MoeLayout {
  uint64_t recv_x_offset = 0;    // bf16 [experts_per_rank][size * max_tokens][hidden]
  uint64_t recv_src_offset = 0;  // int32 [experts_per_rank][size * max_tokens]
  uint64_t stage_offset = 0;     // bf16 [size][max_tokens][hidden]: tokens as they arrive
  uint64_t meta_offset = 0;      // int4 [2][size][max_tokens][1 + top_k]: where each goes
  uint64_t flags_offset = 0;    // u32 [2][size][max_tokens][groups]: each group of 32 vectors there
  uint64_t partial_offset = 0;  // bf16 [size][max_tokens][hidden]: combine's returned sums
  uint64_t partial_flags_offset = 0;  // u32 [size][max_tokens][groups]: of the partial rows
  // Low-latency areas of calls with few tokens (flags in every 16-byte store):
  uint64_t ll_offset = 0;          // [2][size][L][meta + row] dispatch lines
  uint64_t ll_partial_offset = 0;  // [size][L][row] combine's returned sums
  int ll_tokens = 0;               // L: calls of at most this many tokens take that path
  uint64_t data_bytes = 0;
  uint32_t signal_slots = 0;  // 2 sets of one per source (dispatch): how many tokens come
};
Result<MoeLayout> moe_layout(const MoeConfig& config, int members);

class MoeExchange {
 public:
  // `memory` must be joined and large enough (moe_layout); it must outlive this.
  static Result<std::unique_ptr<MoeExchange>> create(SymmetricMemory& memory,
                                                     const MoeConfig& config);
  ~MoeExchange();
  MoeExchange(const MoeExchange&) = delete;
  MoeExchange& operator=(const MoeExchange&) = delete;

  // x: bf16 [num_tokens][hidden], topk_idx: int64 [num_tokens][top_k],
  // topk_weights: float32 [num_tokens][top_k] (device memory of this member's
  // GPU; the weights travel with the tokens and combine uses them).
  // num_tokens in [0, max_tokens].
  Status dispatch(const void* x, const int64_t* topk_idx, const float* topk_weights, int num_tokens,
                  void* stream);
  // y: bf16 [experts_per_rank][size * max_tokens][hidden], rows as recv_x (only
  // the first recv_count rows of each (expert, source) block are read);
  // out: bf16 [tokens of the dispatch before][hidden].
  Status combine(const void* y, void* out, void* stream);
  // The tokens of the last dispatch (combine's out has this many rows).
  int dispatched_tokens() const;

  const MoeConfig& config() const;
  const MoeLayout& layout() const;
  // Device pointers into this member's symmetric buffer / workspace.
  void* recv_x() const;
  int32_t* recv_src() const;
  int32_t* recv_count() const;  // [experts_per_rank][size], written by dispatch

  struct Impl;

 private:
  explicit MoeExchange(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
