#include "core/crc32.h"

#include <array>

namespace ferry {
namespace {

constexpr uint32_t kPolynomial = 0xEDB88320u;  // 0x04C11DB7 bit-reversed

// kTable[b]: the register after shifting the byte b through it bit by bit.
constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t r = b;
    for (int k = 0; k < 8; ++k) r = (r >> 1) ^ ((r & 1u) ? kPolynomial : 0u);
    t[b] = r;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = make_table();

}  // namespace

uint32_t crc32(std::span<const uint8_t> data, uint32_t crc) {
  uint32_t r = ~crc;
  for (uint8_t b : data) r = kTable[(r ^ b) & 0xffu] ^ (r >> 8);
  return ~r;
}

}  // namespace ferry
