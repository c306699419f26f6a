// The dispatch and combine kernels of MoeExchange (moe_kernels.cu) and what
// they take. CUDA C++17: no ferry/status.h here.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "ferry/device_team.h"

namespace ferry::symmetric {

struct MoeKernelArgs {
  DeviceTeam team;
  int num_tokens;
  int hidden;  // bf16 values per row
  int top_k;
  int experts_per_rank;
  int max_tokens;
  uint64_t recv_x_offset;  // in every member's data area
  uint64_t recv_src_offset;
  uint64_t combine_offset;
  uint32_t count_slot;  // first of 2 x experts_per_rank x size count slots
  uint32_t flag_slot;   // first of size x experts_per_rank combine flags
  const int64_t* topk_idx;
  // Workspace, local to this member.
  int32_t* slot_counter;  // [global experts], zero between calls
  // [max_tokens * top_k]: round << 32 | the slot each (token, k) got this round
  unsigned long long* slot_of;
  int32_t* recv_count;              // [experts_per_rank * size]
  unsigned long long* blocks_done;  // monotonic; a block adds 1 when its sends are out
  uint64_t round;  // 1, 2, ...: this call's number (dispatch and combine count apart)
  unsigned long long blocks_done_target;
  // dispatch
  const void* x;
  // combine
  const void* y;
  const float* topk_weights;
  void* out;
};

cudaError_t launch_dispatch(const MoeKernelArgs& args, int blocks, cudaStream_t stream);
cudaError_t launch_combine(const MoeKernelArgs& args, int blocks, cudaStream_t stream);
constexpr int kMoeThreadsPerBlock = 512;
// Loads both kernels now (see preload_kernels in symmetric_kernels.h).
cudaError_t preload_moe_kernels();

}  // namespace ferry::symmetric
