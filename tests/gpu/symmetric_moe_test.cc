// MoE dispatch and combine (include/ferry/moe.h) between two member processes,
// checked against a CPU reference on random inputs: dispatch exactly (every
// received row is its source token, byte for byte, each (token, expert) choice
// exactly once), combine within bf16 tolerance (plus one bf16 rounding of each
// other member's partial sum, which is what crosses NVLink). Shapes: 0, 1, 17,
// 128 and 512 tokens, every token to one expert, every token to the next
// member's experts, most tokens to member 0 only, missing choices (-1), each
// expert chosen twice by a token; low-latency calls (<= 8 tokens) and members
// whose calls differ (low-latency lines from some, staged rows from others);
// and a second configuration (hidden 64, top-3, 3 experts per member). Two
// members, or FERRY_TEST_MEMBERS.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "ferry/moe.h"
#include "ferry/symmetric.h"
#include "member_group.h"
#include "symmetric_test_util.h"

namespace {

using gputest::Member;
using symtest::Check;

float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even, as __float2bfloat16_rn
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

enum class Routing {
  kRandom,
  kOneExpert,
  kOtherMember,
  kSomeMissing,
  kMostToMemberZero,
  kRepeated,  // each token chooses each of its experts twice (choices k and k ^ 1)
};

// What one member feeds in; every member can rebuild every member's inputs.
struct Inputs {
  std::vector<uint16_t> x;     // [tokens][hidden] bf16
  std::vector<int64_t> topk;   // [tokens][top_k]
  std::vector<float> weights;  // [tokens][top_k]
};

Inputs make_inputs(uint64_t seed, int rank, int tokens, const ferry::MoeConfig& cfg, int members,
                   Routing routing) {
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(rank));
  std::uniform_real_distribution<float> value(-2.f, 2.f), weight(0.f, 1.f);
  const int experts = members * cfg.experts_per_rank, K = cfg.top_k;
  Inputs in;
  in.x.resize(static_cast<size_t>(tokens) * cfg.hidden);
  for (auto& v : in.x) v = float_to_bf16(value(rng));
  in.topk.assign(static_cast<size_t>(tokens) * K, -1);
  in.weights.resize(in.topk.size());
  for (auto& w : in.weights) w = weight(rng);
  std::vector<int64_t> order(static_cast<size_t>(experts));
  for (int t = 0; t < tokens; ++t) {
    int64_t* row = in.topk.data() + static_cast<size_t>(t) * K;
    for (int e = 0; e < experts; ++e) order[static_cast<size_t>(e)] = e;
    std::shuffle(order.begin(), order.end(), rng);
    for (int k = 0; k < K && k < experts; ++k) row[k] = order[static_cast<size_t>(k)];
    if (routing == Routing::kOneExpert) {
      for (int k = 0; k < K; ++k) row[k] = k == 0 ? 1 : -1;
    } else if (routing == Routing::kOtherMember) {
      const int owner = (rank + 1) % members;
      for (int k = 0; k < K; ++k) {
        row[k] = k < cfg.experts_per_rank ? owner * cfg.experts_per_rank + k : -1;
      }
    } else if (routing == Routing::kMostToMemberZero) {
      if (t % 5 != 0) {  // member 0's experts only; every fifth token stays random
        for (int k = 0; k < K; ++k) row[k] = k < cfg.experts_per_rank ? k : -1;
      }
    } else if (routing == Routing::kRepeated) {
      for (int k = 1; k < K; k += 2) row[k] = row[k - 1];
    } else if (routing == Routing::kSomeMissing) {
      for (int k = 0; k < K; ++k) {
        if ((t + k) % 3 == 0) row[k] = -1;
      }
    }
  }
  return in;
}

// The expert's computation in this test: scale the row by a per-expert factor
// (so a row returned by the wrong expert shows), rounded to bf16.
float expert_scale(int64_t e) {
  return 1.0f + 0.25f * static_cast<float>(e % 7);
}

struct Case {
  int tokens;
  Routing routing;
  int other_tokens = -1;  // >= 0: the tokens of every member but member 0

  int tokens_of(int rank) const { return rank == 0 || other_tokens < 0 ? tokens : other_tokens; }
};

std::string run_config(Member& m, const ferry::MoeConfig& cfg, const std::vector<Case>& cases,
                       uint64_t seed) {
  Check c;
  const int W = m.size(), me = m.rank(), E = cfg.experts_per_rank, K = cfg.top_k, H = cfg.hidden,
            T = cfg.max_tokens;
  auto layout = ferry::moe_layout(cfg, W);
  if (!layout.ok()) return "moe_layout: " + layout.status().message();
  ferry::SymmetricOptions o;
  o.data_bytes = layout->data_bytes;
  o.signal_slots = layout->signal_slots;
  auto mem = symtest::make_group(m, o, c);
  if (!c.ok()) return c.report();
  auto made = ferry::MoeExchange::create(*mem, cfg);
  if (!made.ok()) return "MoeExchange::create: " + made.status().message();
  auto& moe = *made;
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const uint64_t rows = static_cast<uint64_t>(E) * W * T;
  symtest::DeviceBuffer y(rows * H * 2);
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& cs = cases[ci];
    const std::string name = "case " + std::to_string(ci) + " (" +
                             std::to_string(cs.tokens_of(me)) + " tokens here, " +
                             std::to_string(cs.tokens_of(0)) + " on member 0, routing " +
                             std::to_string(static_cast<int>(cs.routing)) + ")";
    std::vector<Inputs> all;
    for (int r = 0; r < W; ++r) {
      all.push_back(make_inputs(seed + ci, r, cs.tokens_of(r), cfg, W, cs.routing));
    }
    const Inputs& mine = all[static_cast<size_t>(me)];
    auto as_bytes = [](const auto& v) {
      std::vector<uint8_t> b(v.size() * sizeof(v[0]));
      if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
      return b;
    };
    symtest::DeviceBuffer x(as_bytes(mine.x)), topk(as_bytes(mine.topk)),
        weights(as_bytes(mine.weights)), out(static_cast<size_t>(cs.tokens_of(me)) * H * 2);
    c.status(moe->dispatch(x.get(), reinterpret_cast<const int64_t*>(topk.get()),
                           reinterpret_cast<const float*>(weights.get()), cs.tokens_of(me), s),
             name + ": dispatch");
    c.cuda(cudaStreamSynchronize(s), name + ": dispatch ran");
    c.status(mem->device_error(), name + ": device_error after dispatch");
    if (!c.ok()) return c.report();

    // Dispatch, exactly: per (local expert, source) the multiset of tokens.
    const auto counts = symtest::to_host(moe->recv_count(), 4ull * E * W);
    const auto src_idx = symtest::to_host(moe->recv_src(), 4 * rows);
    const auto recv = symtest::to_host(moe->recv_x(), rows * H * 2);
    std::vector<uint16_t> ybuf(rows * H, 0);
    for (int le = 0; le < E; ++le) {
      for (int src = 0; src < W; ++src) {
        const int e = me * E + le;
        std::map<int, int> want;
        const Inputs& in = all[static_cast<size_t>(src)];
        for (int t = 0; t < cs.tokens_of(src); ++t) {
          for (int k = 0; k < K; ++k) want[t] += in.topk[static_cast<size_t>(t) * K + k] == e;
        }
        int expected = 0;
        for (auto& [t, n] : want) expected += n;
        int32_t got = 0;
        std::memcpy(&got, counts.data() + 4 * (static_cast<size_t>(le) * W + src), 4);
        const std::string where =
            name + ": expert " + std::to_string(e) + " from member " + std::to_string(src);
        c.equal(got, expected, where + ": count");
        if (got != expected) continue;
        for (int slot = 0; slot < got; ++slot) {
          const uint64_t row = (static_cast<uint64_t>(le) * W + src) * T + slot;
          int32_t t = -1;
          std::memcpy(&t, src_idx.data() + 4 * row, 4);
          if (t < 0 || t >= cs.tokens_of(src) || want[t] <= 0) {
            c.fail(where + ": slot " + std::to_string(slot) + " names token " + std::to_string(t) +
                   ", which did not choose it (or more often than it did)");
            continue;
          }
          --want[t];
          if (std::memcmp(recv.data() + row * H * 2, in.x.data() + static_cast<size_t>(t) * H,
                          2ull * H) != 0) {
            c.fail(where + ": slot " + std::to_string(slot) + " is not token " + std::to_string(t) +
                   "'s row");
          }
          for (int h = 0; h < H; ++h) {
            uint16_t v;
            std::memcpy(&v, recv.data() + (row * H + h) * 2, 2);
            ybuf[row * H + h] = float_to_bf16(bf16_to_float(v) * expert_scale(e));
          }
        }
      }
    }
    if (!c.ok()) return c.report();

    // Combine: the scaled rows back, weighted sums against the reference.
    c.cuda(cudaMemcpy(y.get(), ybuf.data(), ybuf.size() * 2, cudaMemcpyHostToDevice), "y");
    c.status(moe->combine(y.get(), out.get(), s), name + ": combine");
    c.cuda(cudaStreamSynchronize(s), name + ": combine ran");
    c.status(mem->device_error(), name + ": device_error after combine");
    const auto got = symtest::to_host(out.get(), static_cast<uint64_t>(cs.tokens_of(me)) * H * 2);
    size_t bad = 0;
    std::string first;
    for (int t = 0; t < cs.tokens_of(me); ++t) {
      for (int h = 0; h < H; ++h) {
        // The fp32 reference, and per other member the partial sum that
        // member returns rounded to bf16 (at most 2^-8 of its magnitude off).
        float ref = 0.f;
        std::vector<float> partial(static_cast<size_t>(W), 0.f);
        for (int k = 0; k < K; ++k) {
          const int64_t e = mine.topk[static_cast<size_t>(t) * K + k];
          if (e < 0) continue;
          const float xv = bf16_to_float(mine.x[static_cast<size_t>(t) * H + h]);
          const float term = mine.weights[static_cast<size_t>(t) * K + k] *
                             bf16_to_float(float_to_bf16(xv * expert_scale(e)));
          ref += term;
          partial[static_cast<size_t>(e / E)] += term;
        }
        float rounding = 0.f;
        for (int d = 0; d < W; ++d) {
          if (d != me) rounding += std::fabs(partial[static_cast<size_t>(d)]) / 256.f;
        }
        uint16_t gb;
        std::memcpy(&gb, got.data() + (static_cast<size_t>(t) * H + h) * 2, 2);
        const float g = bf16_to_float(gb);
        if (!(std::fabs(g - ref) <= 1e-2f + 1e-2f * std::fabs(ref) + rounding)) {
          if (bad++ == 0) {
            first = "token " + std::to_string(t) + " [" + std::to_string(h) + "]: got " +
                    std::to_string(g) + ", reference " + std::to_string(ref);
          }
        }
      }
    }
    if (bad != 0) c.fail(name + ": combine: " + std::to_string(bad) + " values off, " + first);
    if (!c.ok()) return c.report();
  }
  cudaStreamDestroy(s);
  m.barrier();
  return c.report();
}

TEST(SymmetricMoe, DispatchAndCombineMatchTheReference) {
  const uint64_t seed = std::random_device{}();
  RUN_MEMBERS([&](Member& m) -> std::string {
    ferry::MoeConfig big;
    big.max_tokens = 512;
    big.hidden = 7168;
    big.top_k = 8;
    big.experts_per_rank = 8;
    std::string r = run_config(m, big,
                               {{0, Routing::kRandom},
                                {1, Routing::kRandom},
                                {128, Routing::kRandom},
                                {512, Routing::kRandom},
                                {300, Routing::kOneExpert},
                                {200, Routing::kOtherMember},
                                {129, Routing::kSomeMissing},
                                {0, Routing::kRandom},
                                {400, Routing::kMostToMemberZero},
                                {64, Routing::kRandom},
                                {1, Routing::kOtherMember},
                                // Low-latency calls (<= 8 tokens): at the bound and past
                                // it, repeated choices, and members whose calls differ:
                                // lines from some members, staged rows from others.
                                {8, Routing::kRandom},
                                {9, Routing::kRandom},
                                {8, Routing::kRepeated},
                                {1, Routing::kRandom, 300},
                                {300, Routing::kRandom, 2},
                                {0, Routing::kRandom, 8},
                                {5, Routing::kOneExpert, 0},
                                {3, Routing::kMostToMemberZero},
                                {2, Routing::kSomeMissing}},
                               seed);
    if (!r.empty()) return "hidden 7168, top-8, 8 experts per member: " + r;
    ferry::MoeConfig small;
    small.max_tokens = 17;
    small.hidden = 64;
    small.top_k = 3;
    small.experts_per_rank = 3;
    small.sm_count = 3;
    r = run_config(m, small,
                   {{17, Routing::kRandom},
                    {5, Routing::kSomeMissing},
                    {0, Routing::kRandom},
                    {17, Routing::kOneExpert},
                    {16, Routing::kMostToMemberZero},
                    {1, Routing::kRandom},
                    {4, Routing::kRepeated, 6},
                    {6, Routing::kRepeated, 3},
                    {8, Routing::kRandom}},
                   seed + 100);
    if (!r.empty()) return "hidden 64, top-3, 3 experts per member, 3 SMs: " + r;
    return "";
  });
}

// Many staged calls in a row with rows of 16 and 128 bytes: the counts,
// meta records, stage rows and partial rows that different members write
// then share 128-byte lines on their receiver, and each round every member
// reads each source's right after that source's signal. A receiver that read
// such a line through a cache filled before the source's write saw 0 counts
// (it happened once in 5 runs of the test above with 4 members).
TEST(SymmetricMoe, ManyStagedRoundsKeepEverySourcesDataApart) {
  const uint64_t seed = std::random_device{}();
  RUN_MEMBERS([&](Member& m) -> std::string {
    // Routings that never choose an expert more than max_tokens times
    // (kRepeated would, and the overflow is another test's subject).
    const Routing routings[] = {Routing::kRandom, Routing::kSomeMissing, Routing::kOtherMember,
                                Routing::kMostToMemberZero};
    for (int hidden : {8, 64}) {
      ferry::MoeConfig cfg;
      cfg.max_tokens = 17;
      cfg.hidden = hidden;
      cfg.top_k = 3;
      cfg.experts_per_rank = 3;
      cfg.sm_count = 3;
      std::vector<Case> cases;
      std::mt19937 rng(static_cast<uint32_t>(seed) + static_cast<uint32_t>(hidden));
      for (int i = 0; i < 150; ++i) {  // 9..17 tokens: past the low-latency bound
        const int tokens = 9 + static_cast<int>(rng() % 9);
        const int other = i % 3 == 0 ? 9 + static_cast<int>(rng() % 9) : -1;
        cases.push_back({tokens, routings[rng() % 4], other});
      }
      const std::string r = run_config(m, cfg, cases, seed + static_cast<uint64_t>(hidden));
      if (!r.empty()) return "hidden " + std::to_string(hidden) + ": " + r;
    }
    return "";
  });
}

TEST(SymmetricMoe, BadConfigurationsAndCallsAreRefused) {
  ferry::MoeConfig cfg;
  cfg.max_tokens = 16;
  cfg.hidden = 12;  // not a multiple of 8
  cfg.top_k = 2;
  cfg.experts_per_rank = 2;
  auto l = ferry::moe_layout(cfg, 2);
  EXPECT_EQ(l.status().code(), ferry::StatusCode::kInvalidArgument);
  EXPECT_NE(l.status().message().find("hidden is 12"), std::string::npos) << l.status().message();
  cfg.hidden = 16;
  cfg.top_k = 33;
  l = ferry::moe_layout(cfg, 2);
  EXPECT_NE(l.status().message().find("top_k is 33"), std::string::npos) << l.status().message();
  cfg.top_k = 2;
  cfg.experts_per_rank = 70000;
  l = ferry::moe_layout(cfg, 2);
  EXPECT_NE(l.status().message().find("experts_per_rank is 70000"), std::string::npos)
      << l.status().message();
  cfg.experts_per_rank = 2;
  l = ferry::moe_layout(cfg, 33);
  EXPECT_NE(l.status().message().find("33 members"), std::string::npos) << l.status().message();
  RUN_MEMBERS([&](Member& m) -> std::string {
    Check c;
    ferry::MoeConfig ok = cfg;
    ok.hidden = 16;
    ok.top_k = 2;
    auto layout = ferry::moe_layout(ok, m.size());
    if (!layout.ok()) return "moe_layout: " + layout.status().message();
    ferry::SymmetricOptions o;
    o.data_bytes = layout->data_bytes - 16;  // too small
    o.signal_slots = layout->signal_slots;
    auto mem = symtest::make_group(m, o, c);
    if (!c.ok()) return c.report();
    c.error_has(ferry::MoeExchange::create(*mem, ok).status(), ferry::StatusCode::kInvalidArgument,
                "this configuration needs");
    // A malformed diagnostic knob is an error naming it, never ignored.
    o.data_bytes = layout->data_bytes;
    auto knob = symtest::make_group(m, o, c);
    if (!c.ok()) return c.report();
    ::setenv("FERRY_MOE_LL_BLOCKS", "0", 1);
    c.error_has(ferry::MoeExchange::create(*knob, ok).status(), ferry::StatusCode::kInvalidArgument,
                "FERRY_MOE_LL_BLOCKS is '0'");
    ::unsetenv("FERRY_MOE_LL_BLOCKS");
    // Calls out of turn are refused before anything runs; the group goes on.
    o.data_bytes = layout->data_bytes;
    auto good = symtest::make_group(m, o, c);
    if (!c.ok()) return c.report();
    auto made = ferry::MoeExchange::create(*good, ok);
    if (!made.ok()) return "MoeExchange::create: " + made.status().message();
    auto& moe = *made;
    symtest::DeviceBuffer out(16 * 2);
    c.error_has(moe->combine(out.get(), out.get(), nullptr), ferry::StatusCode::kInvalidArgument,
                "needs a dispatch() before it");
    c.error_has(moe->dispatch(nullptr, nullptr, nullptr, 1, nullptr),
                ferry::StatusCode::kInvalidArgument, "without x, topk_idx or topk_weights");
    c.error_has(moe->dispatch(nullptr, nullptr, nullptr, 17, nullptr),
                ferry::StatusCode::kInvalidArgument, "num_tokens is 17");
    c.status(moe->dispatch(nullptr, nullptr, nullptr, 0, nullptr), "dispatch of 0 tokens");
    c.error_has(moe->dispatch(nullptr, nullptr, nullptr, 0, nullptr),
                ferry::StatusCode::kInvalidArgument, "without its combine");
    c.status(moe->combine(out.get(), out.get(), nullptr), "combine of 0 tokens");
    c.cuda(cudaDeviceSynchronize(), "the 0-token round ran");
    c.status(good->device_error(), "device_error after the 0-token round");
    m.barrier();
    return c.report();
  });
}

// A combine polls its peers' lines (low latency) or the flags of their
// partial rows (staged) with no signal to wait for: a member that never sends
// them costs one timeout, which names it, and the GPU is not left spinning.
std::string combine_without_its_peer(Member& m, int tokens, const std::string& expected) {
  Check c;
  ferry::MoeConfig cfg;
  cfg.max_tokens = 16;
  cfg.hidden = 64;
  cfg.top_k = 2;
  cfg.experts_per_rank = 2;
  auto layout = ferry::moe_layout(cfg, m.size());
  if (!layout.ok()) return "moe_layout: " + layout.status().message();
  ferry::SymmetricOptions o;
  o.data_bytes = layout->data_bytes;
  o.signal_slots = layout->signal_slots;
  o.wait_timeout_ns = 300'000'000;  // 0.3 s
  auto mem = symtest::make_group(m, o, c);
  if (!c.ok()) return c.report();
  auto made = ferry::MoeExchange::create(*mem, cfg);
  if (!made.ok()) return "MoeExchange::create: " + made.status().message();
  auto& moe = *made;
  // Member 0's tokens go to member 1's experts only.
  const Inputs in = make_inputs(7, m.rank(), tokens, cfg, m.size(),
                                m.rank() == 0 ? Routing::kOtherMember : Routing::kRandom);
  auto as_bytes = [](const auto& v) {
    std::vector<uint8_t> b(v.size() * sizeof(v[0]));
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  symtest::DeviceBuffer x(as_bytes(in.x)), topk(as_bytes(in.topk)), w(as_bytes(in.weights)),
      y(static_cast<size_t>(cfg.experts_per_rank) * m.size() * cfg.max_tokens * cfg.hidden * 2),
      out(static_cast<size_t>(tokens) * cfg.hidden * 2);
  c.status(moe->dispatch(x.get(), reinterpret_cast<const int64_t*>(topk.get()),
                         reinterpret_cast<const float*>(w.get()), tokens, nullptr),
           "dispatch");
  c.cuda(cudaDeviceSynchronize(), "dispatch ran");
  c.status(mem->device_error(), "device_error after dispatch");
  m.barrier();
  if (m.rank() == 0) {  // the others never combine
    c.status(moe->combine(y.get(), out.get(), nullptr), "combine");
    c.cuda(cudaDeviceSynchronize(), "combine returned after its timeout");
    c.error_has(mem->device_error(), ferry::StatusCode::kTimeout, expected);
  }
  m.barrier();
  return c.report();
}

TEST(SymmetricMoe, ACombineWithoutItsPeerTimesOutNamingIt) {
  RUN_MEMBERS([&](Member& m) -> std::string {
    std::string r = combine_without_its_peer(m, 1, "member 1's low-latency data of round 1");
    if (!r.empty()) return "1 token (lines): " + r;
    r = combine_without_its_peer(m, 12, "member 1's staged data of round 1");
    if (!r.empty()) return "12 tokens (staged): " + r;
    return "";
  });
}

}  // namespace
