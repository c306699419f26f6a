// Written from the specification (section 2 of the paper): initialisation,
// compression with c = 2 SipRounds per 8-byte word, finalisation with d = 4.
#include "core/siphash.h"

#include <bit>

namespace ferry {
namespace {

uint64_t load_le64(const uint8_t* p, size_t n = 8) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

struct SipState {
  uint64_t v0, v1, v2, v3;

  void round() {
    v0 += v1;
    v2 += v3;
    v1 = std::rotl(v1, 13);
    v3 = std::rotl(v3, 16);
    v1 ^= v0;
    v3 ^= v2;
    v0 = std::rotl(v0, 32);
    v2 += v1;
    v0 += v3;
    v1 = std::rotl(v1, 17);
    v3 = std::rotl(v3, 21);
    v1 ^= v2;
    v3 ^= v0;
    v2 = std::rotl(v2, 32);
  }
  // One message word: c = 2 rounds.
  void compress(uint64_t m) {
    v3 ^= m;
    round();
    round();
    v0 ^= m;
  }
};

}  // namespace

uint64_t siphash24(std::span<const uint8_t, kSipHashKeyBytes> key,
                   std::span<const uint8_t> message) {
  const uint64_t k0 = load_le64(key.data());
  const uint64_t k1 = load_le64(key.data() + 8);
  // "somepseudorandomlygeneratedbytes"
  SipState s{k0 ^ 0x736f6d6570736575ull, k1 ^ 0x646f72616e646f6dull, k0 ^ 0x6c7967656e657261ull,
             k1 ^ 0x7465646279746573ull};
  const size_t n = message.size();
  const uint8_t* p = message.data();
  const size_t whole = n - n % 8;
  for (size_t i = 0; i < whole; i += 8) s.compress(load_le64(p + i));
  // The last word: the 0 to 7 bytes left, zero-filled, with the message
  // length mod 256 in its most significant byte.
  s.compress(load_le64(p + whole, n % 8) | (static_cast<uint64_t>(n & 0xff) << 56));
  // Finalisation: d = 4 rounds.
  s.v2 ^= 0xff;
  for (int i = 0; i < 4; ++i) s.round();
  return s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
}

}  // namespace ferry
