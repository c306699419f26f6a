// What an engine keeps about lost peers stays bounded: by distinct peers lost
// now, and for one peer that comes back and is lost again and again.
#include "core/lost_peers.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace ferry {
namespace {

TEST(LostPeers, KeepsWhyAPeerWasLostUntilItComesBack) {
  LostPeers lost(4);
  EXPECT_EQ(lost.why(7), nullptr);
  EXPECT_TRUE(lost.lost(7, "link cut").empty());
  ASSERT_NE(lost.why(7), nullptr);
  EXPECT_EQ(*lost.why(7), "link cut");
  lost.lost(7, "keepalive timed out");  // a second transport's loss: the newer reason
  EXPECT_EQ(*lost.why(7), "keepalive timed out");
  EXPECT_EQ(lost.kept(), 1u);
  lost.came_back(7);
  EXPECT_EQ(lost.why(7), nullptr);
  EXPECT_EQ(lost.kept(), 0u);
}

TEST(LostPeers, ForgetsTheOldestLossPastTheBoundAndSkipsPeersThatCameBack) {
  LostPeers lost(3);
  for (PeerId p = 1; p <= 3; ++p) EXPECT_TRUE(lost.lost(p, "gone " + std::to_string(p)).empty());
  lost.came_back(1);  // its entry is stale: never reported as forgotten
  EXPECT_TRUE(lost.lost(4, "gone 4").empty());
  EXPECT_EQ(lost.lost(5, "gone 5"), std::vector<PeerId>{2});
  EXPECT_EQ(lost.lost(6, "gone 6"), std::vector<PeerId>{3});
  EXPECT_EQ(lost.kept(), 3u);
  EXPECT_EQ(lost.why(2), nullptr);
  EXPECT_EQ(*lost.why(6), "gone 6");
}

TEST(LostPeers, APeerLostAgainAndAgainLeavesTheOrderBounded) {
  // One entry per loss of a peer that came back in between used to stay for
  // as long as that peer was lost: the list grew by one per reconnect.
  constexpr size_t kMax = 16;
  LostPeers lost(kMax);
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 100000; ++i) {
    const PeerId p = 1 + rng() % 5;  // a few ids, reused, as the fuzz targets do
    lost.came_back(p);
    EXPECT_TRUE(lost.lost(p, "dropped").empty());
    ASSERT_LE(lost.order_entries(), 2 * kMax + 1) << "after " << i + 1 << " losses";
  }
  EXPECT_EQ(lost.kept(), 5u);
  // Distinct peers past the bound: the oldest go, the order stays bounded.
  for (PeerId p = 100; p < 100 + 10 * kMax; ++p) lost.lost(p, "gone");
  EXPECT_EQ(lost.kept(), kMax);
  EXPECT_LE(lost.order_entries(), 2 * kMax + 1);
}

}  // namespace
}  // namespace ferry
