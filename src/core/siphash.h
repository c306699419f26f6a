// SipHash-2-4 with a 64-bit output (Aumasson and Bernstein, "SipHash: a fast
// short-input PRF", 2012): the keyed hash behind descriptor keys
// (core/region_registry.cc). Same output as libsodium's crypto_shorthash,
// which the engine used before; tests/unit/siphash_test.cc holds vectors
// taken from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace ferry {

constexpr size_t kSipHashKeyBytes = 16;

// SipHash-2-4 of `message` under `key` (read as two little-endian u64 words).
// The 8 output bytes of the specification, as the little-endian u64 they
// encode: memcpy of the result equals crypto_shorthash's output on x86.
uint64_t siphash24(std::span<const uint8_t, kSipHashKeyBytes> key,
                   std::span<const uint8_t> message);

}  // namespace ferry
