// Helpers shared by tcp_gpu_memory_test and its target process.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace gputest {

// The GPU a test's target process uses: $FERRY_TEST_PEER_DEVICE, else 0. Set
// to 1 on a machine with two GPUs, the target's memory is on the other GPU
// than the initiator's (GPU 0), as between a prefill and a decode server.
inline int peer_device() {
  const char* v = std::getenv("FERRY_TEST_PEER_DEVICE");
  return v != nullptr && *v != 0 ? std::atoi(v) : 0;
}

inline std::string hex(const std::vector<uint8_t>& b) {
  std::string s;
  char buf[3];
  for (uint8_t x : b) {
    std::snprintf(buf, sizeof buf, "%02x", x);
    s += buf;
  }
  return s;
}

inline std::vector<uint8_t> unhex(const std::string& s) {
  std::vector<uint8_t> b(s.size() / 2);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  return b;
}

inline void fill(uint8_t* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = rng();
    __builtin_memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

inline uint64_t fnv(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace gputest
