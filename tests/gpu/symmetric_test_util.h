// Helpers of the symmetric-memory tests: checks that collect every failure of
// a member into its report, device buffers, random data reproducible by the
// other member, and a group made and joined in one call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/symmetric.h"
#include "member_group.h"
#include "symmetric_test_kernels.h"

namespace symtest {

class Check {
 public:
  bool ok() const { return failures_.empty(); }
  std::string report() const { return failures_; }
  void fail(const std::string& what) {
    if (failures_.size() < 4000) failures_ += what + "\n";
  }
  void truth(bool v, const std::string& what) {
    if (!v) fail("false: " + what);
  }
  template <typename T>
  void equal(const T& got, const T& want, const std::string& what) {
    if (got == want) return;
    std::ostringstream s;
    s << what << ": got " << got << ", expected " << want;
    fail(s.str());
  }
  void status(const ferry::Status& s, const std::string& what) {
    if (!s.ok()) fail(what + ": " + s.message());
  }
  void cuda(cudaError_t e, const std::string& what) {
    if (e != cudaSuccess) fail(what + ": " + cudaGetErrorString(e));
  }
  void error_has(const ferry::Status& s, ferry::StatusCode code, const std::string& words) {
    if (s.code() != code || s.message().find(words) == std::string::npos) {
      fail("expected an error " + std::string(ferry::status_code_name(code)) + " saying '" + words +
           "', got " + std::string(ferry::status_code_name(s.code())) + ": " + s.message());
    }
  }
  void bytes_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                   const std::string& what) {
    if (got.size() != want.size()) {
      fail(what + ": " + std::to_string(got.size()) + " bytes, expected " +
           std::to_string(want.size()));
      return;
    }
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want[i] && bad++ == 0) first = i;
    }
    if (bad != 0) {
      fail(what + ": " + std::to_string(bad) + " of " + std::to_string(got.size()) +
           " bytes differ, the first at " + std::to_string(first));
    }
  }

 private:
  std::string failures_;
};

inline std::vector<uint8_t> random_bytes(uint64_t seed, int rank, uint64_t n) {
  std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(rank));
  std::vector<uint8_t> out(n);
  for (uint64_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(out.data() + i, &v, std::min<uint64_t>(8, n - i));
  }
  return out;
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<uint8_t>& bytes) : n_(bytes.size()) {
    cudaMalloc(&p_, std::max<size_t>(n_, 16));
    cudaMemcpy(p_, bytes.data(), n_, cudaMemcpyHostToDevice);
    // From pageable memory cudaMemcpy may return before its last DMA lands
    // (on the legacy stream); work on other streams must not read it early.
    cudaDeviceSynchronize();
  }
  explicit DeviceBuffer(size_t n) : n_(n) {
    cudaMalloc(&p_, std::max<size_t>(n_, 16));
    cudaMemset(p_, 0, std::max<size_t>(n_, 16));
    cudaDeviceSynchronize();  // cudaMemset is asynchronous to the host
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(p_); }
  int host_int() const {
    int v = 0;
    cudaMemcpy(&v, p_, sizeof v, cudaMemcpyDeviceToHost);
    return v;
  }

 private:
  void* p_ = nullptr;
  size_t n_;
};

inline std::vector<uint8_t> to_host(const void* device, uint64_t n) {
  std::vector<uint8_t> out(n);
  cudaMemcpy(out.data(), device, n, cudaMemcpyDeviceToHost);
  return out;
}

inline std::string boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string s;
  std::getline(f, s);
  return s;
}

// Members per test: FERRY_TEST_MEMBERS (2..8), default 2. MoE spreads experts
// over 4-8 GPUs, so the same tests run with 4 members where 4 GPUs exist.
inline int members_from_env() {
  const char* v = std::getenv("FERRY_TEST_MEMBERS");
  if (v == nullptr || *v == '\0') return 2;
  const int n = std::atoi(v);
  return n >= 2 && n <= 8 ? n : 2;
}

// "" when this member has the GPUs the tests need, else "SKIP: why".
inline std::string need_gpus(int members) {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    return std::string("SKIP: no usable GPU: ") + cudaGetErrorString(e);
  }
  if (n < members) {
    return "SKIP: " + std::to_string(members) + " GPUs needed (one per member), " +
           std::to_string(n) + " visible";
  }
  return "";
}

// Creates member m's buffer on GPU m.rank() and joins the group; failures go into c.
inline std::unique_ptr<ferry::SymmetricMemory> make_group(const gputest::Member& m,
                                                          ferry::SymmetricOptions o, Check& c) {
  o.rank = m.rank();
  o.size = m.size();
  o.device = m.rank();
  auto created = ferry::SymmetricMemory::create(o);
  if (!created.ok()) {
    c.fail("create: " + created.status().message());
    m.all_gather({});  // keep the rounds in step with the other members
    return nullptr;
  }
  auto cards = m.all_gather((*created)->card());
  c.status((*created)->join(cards), "join");
  return std::move(*created);
}

}  // namespace symtest

// Runs `body` in members_from_env() member processes (one GPU each) and reports each
// member's failures; skips when a member says why it cannot run.
#define RUN_MEMBERS(...)                                                               \
  do {                                                                                 \
    auto body_fn = (__VA_ARGS__);                                                      \
    const auto reports =                                                               \
        gputest::run_members(symtest::members_from_env(), [&](gputest::Member& m) {    \
          std::string skip = symtest::need_gpus(m.size());                             \
          if (!skip.empty()) return skip;                                              \
          cudaSetDevice(m.rank());                                                     \
          if (symtest::preload() != cudaSuccess) return std::string("preload failed"); \
          return body_fn(m);                                                           \
        });                                                                            \
    for (const auto& r : reports) {                                                    \
      if (r.rfind("SKIP:", 0) == 0) GTEST_SKIP() << r;                                 \
    }                                                                                  \
    for (size_t i = 0; i < reports.size(); ++i) {                                      \
      EXPECT_EQ(reports[i], "") << "member " << i;                                     \
    }                                                                                  \
  } while (0)
