// Low-latency MoE dispatch and combine over a symmetric group
// (include/ferry/symmetric.h), built on the device API (include/ferry/device.cuh).
//
// Every member holds `experts_per_rank` experts; global expert e lives on
// member e / experts_per_rank. Per call a member has up to `max_tokens` tokens
// of `hidden` bf16 values and routes each to `top_k` global experts
// (topk_idx: int64, -1 = no expert).
//
//  dispatch: every (token, k) copy of a token goes straight into the expert's
//    member's receive buffer, recv_x[local expert][source member][slot][hidden]
//    (slot: arrival order, not token order), its token index into
//    recv_src[...][slot]; the count per (local expert, source) is signalled
//    (release, system scope) after the data and lands in recv_count()
//    [local expert][source] (int32). One kernel; returns when this member has
//    received every count.
//  combine: the expert outputs y, laid out like recv_x, go back to the members
//    the tokens came from, which sum them weighted by topk_weights (float32,
//    accumulated in fp32) into out[token][hidden] (bf16). Contributions from this
//    member's own experts are read in place, never copied.
//
// Calls alternate dispatch, combine, dispatch, ... on one stream per member
// (the combine of a round is what tells a member that its peers are done with
// its previous dispatch's data); each member makes the same calls.
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
  uint64_t combine_offset = 0;   // bf16 [size * experts_per_rank][max_tokens][hidden]
  uint64_t data_bytes = 0;
  uint32_t signal_slots = 0;  // 2 sets of counts per (expert, source), a flag per global expert
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

  // x: bf16 [num_tokens][hidden], topk_idx: int64 [num_tokens][top_k] (device
  // memory of this member's GPU). num_tokens in [0, max_tokens].
  Status dispatch(const void* x, const int64_t* topk_idx, int num_tokens, void* stream);
  // y: bf16 [experts_per_rank][size * max_tokens][hidden], rows as recv_x (only
  // the first recv_count rows of each (expert, source) block are read);
  // topk_idx and topk_weights (float32 [num_tokens][top_k]) those of the
  // dispatch before; out: bf16 [num_tokens][hidden].
  Status combine(const void* y, const int64_t* topk_idx, const float* topk_weights, int num_tokens,
                 void* out, void* stream);

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
