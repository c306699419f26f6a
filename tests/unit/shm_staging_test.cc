// The shm staging pieces: the ring that hands out ranges of an initiator's
// area (checked against a model under random allocation and out-of-order
// release), and the areas themselves (created sealed, adopted only when
// sealed against shrinking and of the announced size, bounds checks).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "transport/shm/staging.h"

namespace ferry::shm {
namespace {

TEST(StagingRing, HandsOutAlignedRangesInOrderAndWraps) {
  StagingRing ring(1024);
  auto a = ring.allocate(100);  // 128 with alignment
  auto b = ring.allocate(64);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(*b, 128u);
  EXPECT_FALSE(ring.allocate(0));
  EXPECT_FALSE(ring.allocate(1025));
  auto c = ring.allocate(832);  // the rest: [192, 1024)
  ASSERT_TRUE(c);
  EXPECT_EQ(*c, 192u);
  EXPECT_FALSE(ring.allocate(1));
  // Out of order: b back first frees nothing (a is older).
  EXPECT_TRUE(ring.release(*b));
  EXPECT_FALSE(ring.allocate(64));
  EXPECT_TRUE(ring.release(*a));
  // [0, 192) is free now; a range does not wrap around the end.
  auto d = ring.allocate(192);
  ASSERT_TRUE(d);
  EXPECT_EQ(*d, 0u);
  EXPECT_FALSE(ring.allocate(64));
  EXPECT_FALSE(ring.release(12345));  // not a range in use
  EXPECT_FALSE(ring.release(*b));     // given back already
  EXPECT_TRUE(ring.release(*c));
  EXPECT_TRUE(ring.release(*d));
  EXPECT_EQ(ring.ranges(), 0u);
  auto e = ring.allocate(1024);  // all of it once empty
  ASSERT_TRUE(e);
  EXPECT_EQ(*e, 0u);
}

TEST(StagingRing, NeverOverlapsUnderRandomUse) {
  constexpr uint64_t kCapacity = 1 << 16;
  StagingRing ring(kCapacity);
  std::mt19937_64 rng(42);
  std::map<uint64_t, uint64_t> live;  // offset → length
  uint64_t allocated = 0;
  for (int step = 0; step < 200000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const uint64_t length = 1 + rng() % (kCapacity / 8);
      auto at = ring.allocate(length);
      if (!at) {
        // Refused only when full enough: at most 3 of 4 ranges may be
        // stuck behind the oldest, so never with nothing in use.
        ASSERT_FALSE(live.empty());
        continue;
      }
      ASSERT_EQ(*at % kStagingAlign, 0u);
      ASSERT_LE(*at + length, kCapacity);
      // No overlap with any live range.
      auto next = live.lower_bound(*at);
      if (next != live.end()) {
        ASSERT_LE(*at + length, next->first) << step;
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, *at) << step;
      }
      live.emplace(*at, length);
      ++allocated;
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      ASSERT_TRUE(ring.release(it->first));
      live.erase(it);
    }
    ASSERT_EQ(ring.ranges(), live.size());
  }
  EXPECT_GT(allocated, 50000u);
  for (const auto& [offset, length] : live) ASSERT_TRUE(ring.release(offset));
  EXPECT_TRUE(ring.allocate(kCapacity));
}

TEST(StagingArea, CreatedSealedAndMapped) {
  auto a = StagingArea::create(kMinStagingBytes, "ferry-test");
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->size(), kMinStagingBytes);
  const int seals = fcntl(a->fd(), F_GET_SEALS);
  EXPECT_EQ(seals & kRequiredSeals, kRequiredSeals);
  EXPECT_NE(seals & F_SEAL_GROW, 0);
  EXPECT_NE(ftruncate(a->fd(), 4096), 0);  // the seal holds
  a->data()[0] = 1;
  a->data()[a->size() - 1] = 2;
  EXPECT_TRUE(a->contains(0, a->size()));
  EXPECT_TRUE(a->contains(a->size(), 0));
  EXPECT_FALSE(a->contains(a->size() - 1, 2));
  EXPECT_FALSE(a->contains(UINT64_MAX - 1, 8));
  EXPECT_FALSE(a->contains(8, UINT64_MAX - 1));
  EXPECT_FALSE(StagingArea::create(kMinStagingBytes - 1, "x").ok());
  EXPECT_FALSE(StagingArea::create(kMaxStagingBytes + 1, "x").ok());
}

// Pages of `area` backed by memory (mincore: for a shared mapping, the memfd's pages).
size_t resident_pages(const StagingArea& area) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> v((area.size() + page - 1) / page);
  EXPECT_EQ(mincore(area.data(), area.size(), v.data()), 0);
  return static_cast<size_t>(
      std::count_if(v.begin(), v.end(), [](unsigned char c) { return c & 1; }));
}

TEST(StagingArea, PopulateBacksEveryPageAndKeepsItsBytes) {
  auto mine = StagingArea::create(2 * kMinStagingBytes, "ferry-test");
  ASSERT_TRUE(mine.ok()) << mine.status().message();
  const size_t pages = mine->size() / static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::mt19937_64 rng(7);
  std::vector<uint8_t> pattern(4096);
  for (auto& b : pattern) b = static_cast<uint8_t>(rng());
  std::copy(pattern.begin(), pattern.end(), mine->data() + 12345);  // some bytes written before
  auto theirs = StagingArea::adopt(dup(mine->fd()), mine->size());
  ASSERT_TRUE(theirs.ok()) << theirs.status().message();
  EXPECT_LT(resident_pages(*theirs), pages);  // mapped lazily
  ASSERT_TRUE(mine->populate("this engine's area").ok());
  ASSERT_TRUE(theirs->populate("the peer's area").ok());
  EXPECT_EQ(resident_pages(*mine), pages);
  EXPECT_EQ(resident_pages(*theirs), pages);
  EXPECT_TRUE(std::equal(pattern.begin(), pattern.end(), theirs->data() + 12345));
  EXPECT_TRUE(
      std::all_of(theirs->data(), theirs->data() + 12345, [](uint8_t b) { return b == 0; }));
  EXPECT_TRUE(StagingArea().populate("an empty area").ok());
}

TEST(StagingArea, AdoptSharesTheBytesAndChecksTheDescriptor) {
  auto mine = StagingArea::create(2 * kMinStagingBytes, "ferry-test");
  ASSERT_TRUE(mine.ok());
  // The peer's view: a duplicate descriptor, as SCM_RIGHTS would deliver.
  auto theirs = StagingArea::adopt(dup(mine->fd()), mine->size());
  ASSERT_TRUE(theirs.ok()) << theirs.status().to_string();
  EXPECT_EQ(theirs->fd(), -1);  // the mapping is all it keeps
  mine->data()[12345] = 0x77;
  EXPECT_EQ(theirs->data()[12345], 0x77);
  theirs->data()[kMinStagingBytes + 1] = 0x88;
  EXPECT_EQ(mine->data()[kMinStagingBytes + 1], 0x88);

  // Another size than announced.
  auto wrong = StagingArea::adopt(dup(mine->fd()), kMinStagingBytes);
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kProtocolError);
  EXPECT_NE(wrong.status().message().find("2097152 bytes, it announced 1048576"), std::string::npos)
      << wrong.status().message();
  // Sizes outside the limits are refused before anything is mapped.
  EXPECT_FALSE(StagingArea::adopt(dup(mine->fd()), kMaxStagingBytes + 1).ok());

  // Not sealed against shrinking.
  const int loose = memfd_create("loose", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(loose, 0);
  ASSERT_EQ(ftruncate(loose, kMinStagingBytes), 0);
  ASSERT_EQ(fcntl(loose, F_ADD_SEALS, F_SEAL_GROW), 0);
  auto unsealed = StagingArea::adopt(dup(loose), kMinStagingBytes);
  ASSERT_FALSE(unsealed.ok());
  EXPECT_NE(unsealed.status().message().find("could shrink"), std::string::npos)
      << unsealed.status().message();
  close(loose);

  // Not a memfd.
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  auto pipe_area = StagingArea::adopt(pipefd[0], kMinStagingBytes);
  ASSERT_FALSE(pipe_area.ok());
  EXPECT_NE(pipe_area.status().message().find("not a sealable memfd"), std::string::npos)
      << pipe_area.status().message();
  close(pipefd[1]);
}

}  // namespace
}  // namespace ferry::shm
