// How a host-posted symmetric put splits its bytes over blocks
// (src/symmetric/put_share.h): every byte covered exactly once, shares of
// whole 16-byte vectors, for sizes around every boundary. The 4 MiB + 48 B put
// of SymmetricTest.HostPutSignalWaitMoveEveryByte once lost its last 32 bytes
// to a share rounded down.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "symmetric/put_share.h"

namespace {

using ferry::symmetric::put_share;
using ferry::symmetric::put_share_bytes;

void expect_exact_cover(uint64_t bytes, uint64_t blocks) {
  uint64_t next = 0;
  for (uint64_t b = 0; b < blocks; ++b) {
    uint64_t first = 0, n = 0;
    put_share(bytes, blocks, b, &first, &n);
    if (n == 0) continue;
    ASSERT_EQ(first, next) << bytes << " bytes over " << blocks << " blocks, block " << b;
    ASSERT_EQ(first % 16, 0u) << bytes << " bytes over " << blocks << " blocks, block " << b;
    next = first + n;
  }
  EXPECT_EQ(next, bytes) << bytes << " bytes over " << blocks << " blocks";
}

TEST(SymmetricPutShare, EveryByteOnceInWholeVectors) {
  // The case that lost 32 bytes: 4 MiB + 48 over 65 blocks (one per 64 KiB, rounded up).
  expect_exact_cover((4u << 20) + 48, 65);
  EXPECT_GE(put_share_bytes((4u << 20) + 48, 65) * 65, (4u << 20) + 48);
  for (uint64_t bytes : {1ull, 15ull, 16ull, 17ull, 1000ull, 4095ull, 65536ull, 65537ull,
                         (1ull << 20) + 64, (16ull << 20) - 1, (256ull << 20) + 16}) {
    for (uint64_t blocks : {1ull, 2ull, 3ull, 7ull, 8ull, 65ull, 132ull, 1000ull}) {
      expect_exact_cover(bytes, blocks);
    }
  }
}

}  // namespace
