// MoeExchange (include/ferry/moe.h): checks, the buffer layout, the local
// workspace and the per-call round numbers of the dispatch/combine kernels.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "cuda/cuda_util.h"
#include "ferry/moe.h"
#include "fmt/format.h"
#include "symmetric/moe_kernels.h"

namespace ferry {
namespace {

using cuda::cuda_status;

uint64_t align_up(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

// FERRY_MOE_LL_BLOCKS (diagnostic, docs/device_api.md): the blocks a
// low-latency call launches, 1..1024, instead of kLowLatencyBlocks.
Result<int> low_latency_blocks() {
  const char* v = std::getenv("FERRY_MOE_LL_BLOCKS");
  if (v == nullptr || *v == 0) return symmetric::kLowLatencyBlocks;
  const std::string_view text(v);
  int n = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end != text.data() + text.size() || n < 1 || n > 1024) {
    return err::InvalidArgument(fmt::format(
        "moe: FERRY_MOE_LL_BLOCKS is '{}', must be a number of blocks in [1, 1024]", text));
  }
  return n;
}

Status check_config(const MoeConfig& c, int members) {
  if (members < 1 || members > 32) {
    return err::InvalidArgument(
        fmt::format("moe: {} members, must be in [1, 32] (one bit per member)", members));
  }
  if (c.max_tokens < 1) {
    return err::InvalidArgument(fmt::format("moe: max_tokens is {}, must be >= 1", c.max_tokens));
  }
  if (c.hidden < 8 || c.hidden % 8 != 0) {
    return err::InvalidArgument(fmt::format(
        "moe: hidden is {}, must be a positive multiple of 8 (rows of whole 16-byte vectors)",
        c.hidden));
  }
  if (c.top_k < 1 || c.top_k > 32) {
    return err::InvalidArgument(fmt::format("moe: top_k is {}, must be in [1, 32]", c.top_k));
  }
  if (c.experts_per_rank < 1) {
    return err::InvalidArgument(
        fmt::format("moe: experts_per_rank is {}, must be >= 1", c.experts_per_rank));
  }
  if (c.experts_per_rank > 0xffff) {
    return err::InvalidArgument(fmt::format(
        "moe: experts_per_rank is {}, must be <= 65535 (low-latency lines carry it in 16 bits)",
        c.experts_per_rank));
  }
  if (c.sm_count < 0) {
    return err::InvalidArgument(fmt::format("moe: sm_count is {}, must be >= 0", c.sm_count));
  }
  if (static_cast<uint64_t>(c.max_tokens) * members >= (1ull << 31)) {
    return err::InvalidArgument("moe: max_tokens x members must stay below 2^31");
  }
  return Status::Ok();
}

}  // namespace

Result<MoeLayout> moe_layout(const MoeConfig& c, int members) {
  if (Status s = check_config(c, members); !s.ok()) return s;
  const uint64_t E = static_cast<uint64_t>(c.experts_per_rank), W = static_cast<uint64_t>(members);
  const uint64_t T = static_cast<uint64_t>(c.max_tokens), H = static_cast<uint64_t>(c.hidden);
  const uint64_t K = static_cast<uint64_t>(c.top_k);
  MoeLayout l;
  l.recv_x_offset = 0;
  l.recv_src_offset = align_up(E * W * T * H * 2, 256);
  l.stage_offset = align_up(l.recv_src_offset + E * W * T * 4, 256);
  l.meta_offset = align_up(l.stage_offset + W * T * H * 2, 256);
  const uint64_t G = (H / 8 + 31) / 32;  // flagged groups of 32 row vectors
  l.flags_offset = align_up(l.meta_offset + 2 * W * T * (1 + K) * 16, 256);
  l.partial_offset = align_up(l.flags_offset + 2 * W * T * G * 4, 256);
  l.partial_flags_offset = align_up(l.partial_offset + W * T * H * 2, 256);
  const uint64_t L = std::min<uint64_t>(T, symmetric::kLowLatencyTokens);
  const uint64_t ll_line = (1 + K + 2 * (H / 8)) * 16;  // meta, then the row
  l.ll_tokens = static_cast<int>(L);
  l.ll_offset = align_up(l.partial_flags_offset + W * T * G * 4, 256);
  l.ll_partial_offset = align_up(l.ll_offset + 2 * W * L * ll_line, 256);
  l.data_bytes = l.ll_partial_offset + W * L * 2 * (H / 8) * 16;
  l.signal_slots = static_cast<uint32_t>(2 * W);
  return l;
}

struct MoeExchange::Impl {
  SymmetricMemory* memory = nullptr;
  MoeConfig config;
  MoeLayout layout;
  int blocks = 0;
  int ll_blocks = symmetric::kLowLatencyBlocks;
  void* workspace = nullptr;
  int32_t* slot_counter = nullptr;
  unsigned long long* slot_of = nullptr;
  int32_t* recv_count = nullptr;
  int32_t* tokens_from = nullptr;
  uint32_t* remote_members = nullptr;
  unsigned int* units_done = nullptr;
  uint32_t* counts_zeroed = nullptr;
  uint64_t dispatch_round = 0;
  uint64_t combine_round = 0;
  int dispatched_tokens = 0;

  ~Impl() {
    if (workspace != nullptr) {
      cuda::DeviceGuard guard(memory->device());
      cudaFree(workspace);
      cudaGetLastError();
    }
  }

  symmetric::MoeKernelArgs args(int num_tokens) const {
    symmetric::MoeKernelArgs a{};
    a.team = memory->team();
    a.num_tokens = num_tokens;
    a.hidden = config.hidden;
    a.top_k = config.top_k;
    a.experts_per_rank = config.experts_per_rank;
    a.max_tokens = config.max_tokens;
    a.recv_x_offset = layout.recv_x_offset;
    a.recv_src_offset = layout.recv_src_offset;
    a.stage_offset = layout.stage_offset;
    a.meta_offset = layout.meta_offset;
    a.flags_offset = layout.flags_offset;
    a.partial_offset = layout.partial_offset;
    a.partial_flags_offset = layout.partial_flags_offset;
    a.ll_offset = layout.ll_offset;
    a.ll_partial_offset = layout.ll_partial_offset;
    a.ll_tokens = layout.ll_tokens;
    a.dispatch_slot = 0;
    a.slot_counter = slot_counter;
    a.slot_of = slot_of;
    a.recv_count = recv_count;
    a.tokens_from = tokens_from;
    a.remote_members = remote_members;
    a.units_done = units_done;
    a.counts_zeroed = counts_zeroed;
    return a;
  }

  // A low-latency call (few tokens) starts and ends fewer blocks.
  int blocks_for(int num_tokens) const {
    return num_tokens <= layout.ll_tokens ? std::min(blocks, ll_blocks) : blocks;
  }

  Status check_tokens(int num_tokens) const {
    if (num_tokens < 0 || num_tokens > config.max_tokens) {
      return err::InvalidArgument(
          fmt::format("moe: num_tokens is {}, must be in [0, {}]", num_tokens, config.max_tokens));
    }
    return Status::Ok();
  }
};

MoeExchange::MoeExchange(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeExchange::~MoeExchange() = default;

Result<std::unique_ptr<MoeExchange>> MoeExchange::create(SymmetricMemory& memory,
                                                         const MoeConfig& config) {
  if (!memory.joined()) return err::InvalidArgument("moe: join() the symmetric memory first");
  auto layout = moe_layout(config, memory.size());
  if (!layout.ok()) return layout.status();
  if (memory.data_bytes() < layout->data_bytes || memory.signal_slots() < layout->signal_slots) {
    return err::InvalidArgument(fmt::format(
        "moe: the symmetric memory has {} data bytes and {} signal slots; this configuration "
        "needs {} and {} (moe_layout)",
        memory.data_bytes(), memory.signal_slots(), layout->data_bytes, layout->signal_slots));
  }
  auto impl = std::make_unique<Impl>();
  impl->memory = &memory;
  impl->config = config;
  impl->layout = *layout;
  cuda::DeviceGuard guard(memory.device());
  int sms = 0;
  if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, memory.device());
      e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "moe: cudaDeviceGetAttribute(multiprocessor count)");
  }
  impl->blocks = config.sm_count == 0 ? sms : std::min(config.sm_count, sms);
  auto ll_blocks = low_latency_blocks();
  if (!ll_blocks.ok()) return ll_blocks.status();
  impl->ll_blocks = *ll_blocks;
  // Workspace: the unit count and counts_zeroed, then 8-byte words, then 4-byte words.
  const uint64_t W = static_cast<uint64_t>(memory.size());
  const uint64_t experts = W * config.experts_per_rank;
  const uint64_t slot_of = static_cast<uint64_t>(config.max_tokens) * config.top_k;
  const uint64_t bytes =
      16 + 8 * slot_of + 4 * (experts + experts + W + static_cast<uint64_t>(config.max_tokens));
  if (cudaError_t e = cudaMalloc(&impl->workspace, bytes); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "moe: cudaMalloc(workspace)");
  }
  if (cudaError_t e = cudaMemset(impl->workspace, 0, bytes); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "moe: cudaMemset(workspace)");
  }
  auto* base = static_cast<uint8_t*>(impl->workspace);
  impl->units_done = reinterpret_cast<unsigned int*>(base);
  impl->counts_zeroed = reinterpret_cast<uint32_t*>(base + 4);
  impl->slot_of = reinterpret_cast<unsigned long long*>(base + 16);
  impl->slot_counter = reinterpret_cast<int32_t*>(impl->slot_of + slot_of);
  impl->recv_count = impl->slot_counter + experts;
  impl->tokens_from = impl->recv_count + experts;
  impl->remote_members = reinterpret_cast<uint32_t*>(impl->tokens_from + W);
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "moe: cudaDeviceSynchronize");
  }
  return std::unique_ptr<MoeExchange>(new MoeExchange(std::move(impl)));
}

Status MoeExchange::dispatch(const void* x, const int64_t* topk_idx, const float* topk_weights,
                             int num_tokens, void* stream) {
  Impl& m = *impl_;
  if (Status s = m.check_tokens(num_tokens); !s.ok()) return s;
  if (num_tokens > 0 && (x == nullptr || topk_idx == nullptr || topk_weights == nullptr)) {
    return err::InvalidArgument("moe: dispatch of tokens without x, topk_idx or topk_weights");
  }
  if (m.combine_round != m.dispatch_round) {
    return err::InvalidArgument(
        "moe: dispatch() after a dispatch() without its combine() (calls alternate)");
  }
  symmetric::MoeKernelArgs a = m.args(num_tokens);
  a.x = x;
  a.topk_idx = topk_idx;
  a.topk_weights = topk_weights;
  a.round = m.dispatch_round + 1;
  cuda::DeviceGuard guard(m.memory->device());
  if (Status s = cuda_status(symmetric::launch_dispatch(a, m.blocks_for(num_tokens),
                                                        static_cast<cudaStream_t>(stream)),
                             "moe: dispatch kernel launch");
      !s.ok()) {
    return s;
  }
  m.dispatch_round = a.round;
  m.dispatched_tokens = num_tokens;
  return Status::Ok();
}

Status MoeExchange::combine(const void* y, void* out, void* stream) {
  Impl& m = *impl_;
  if (m.combine_round >= m.dispatch_round) {
    return err::InvalidArgument("moe: combine() needs a dispatch() before it");
  }
  if (y == nullptr) return err::InvalidArgument("moe: combine without y");
  if (m.dispatched_tokens > 0 && out == nullptr) {
    return err::InvalidArgument("moe: combine of tokens without out");
  }
  symmetric::MoeKernelArgs a = m.args(m.dispatched_tokens);
  a.y = y;
  a.out = out;
  a.round = m.dispatch_round;
  cuda::DeviceGuard guard(m.memory->device());
  if (Status s = cuda_status(symmetric::launch_combine(a, m.blocks_for(m.dispatched_tokens),
                                                       static_cast<cudaStream_t>(stream)),
                             "moe: combine kernel launch");
      !s.ok()) {
    return s;
  }
  m.combine_round = a.round;
  return Status::Ok();
}

int MoeExchange::dispatched_tokens() const {
  return impl_->dispatched_tokens;
}

const MoeConfig& MoeExchange::config() const {
  return impl_->config;
}
const MoeLayout& MoeExchange::layout() const {
  return impl_->layout;
}
void* MoeExchange::recv_x() const {
  return static_cast<uint8_t*>(impl_->memory->local_data()) + impl_->layout.recv_x_offset;
}
int32_t* MoeExchange::recv_src() const {
  return reinterpret_cast<int32_t*>(static_cast<uint8_t*>(impl_->memory->local_data()) +
                                    impl_->layout.recv_src_offset);
}
int32_t* MoeExchange::recv_count() const {
  return impl_->recv_count;
}

}  // namespace ferry
