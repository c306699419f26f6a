// The engine's queue of notifications not yet taken stays within its bound:
// past it new ones are dropped and counted, what is kept is the oldest, in
// order, and taking them makes room again.
#include "core/notification_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

namespace ferry {
namespace {

using namespace std::chrono_literals;

Bytes Payload(int i, size_t size) {
  Bytes b(size, static_cast<uint8_t>(i));
  const std::string tag = std::to_string(i);
  for (size_t k = 0; k < tag.size() && k < size; ++k) b[k] = static_cast<uint8_t>(tag[k]);
  return b;
}

TEST(NotificationQueue, KeepsTheOldestInOrderAndCountsWhatItDrops) {
  constexpr uint64_t kPayload = 36;  // 100 B each with the entry's overhead
  NotificationQueue q(1000);
  int kept = 0;
  for (int i = 0; i < 25; ++i) {
    if (q.push(static_cast<PeerId>(i % 3 + 1), Payload(i, kPayload))) ++kept;
  }
  EXPECT_EQ(kept, 10);
  EXPECT_EQ(q.dropped(), 15u);
  EXPECT_EQ(q.queued_bytes(), 10 * (kPayload + NotificationQueue::kEntryOverhead));
  auto got = q.take();
  ASSERT_EQ(got.size(), 10u);
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(got[i].payload, Payload(i, kPayload)) << "entry " << i;
    EXPECT_EQ(got[i].peer, static_cast<PeerId>(i % 3 + 1));
  }
  EXPECT_EQ(q.queued_bytes(), 0u);
  // Room again; the count of drops stays.
  EXPECT_TRUE(q.push(9, Payload(99, kPayload)));
  EXPECT_EQ(q.take().size(), 1u);
  EXPECT_EQ(q.dropped(), 15u);
}

TEST(NotificationQueue, ALargeNotificationDoesNotPassTheBoundAndSmallOnesStillFit) {
  NotificationQueue q(4096);
  EXPECT_FALSE(q.push(1, Bytes(5000, 1)));
  EXPECT_TRUE(q.push(1, Bytes(10, 2)));
  EXPECT_EQ(q.dropped(), 1u);
  q.set_max_bytes(1 << 20);  // the bound can be raised
  EXPECT_TRUE(q.push(1, Bytes(5000, 3)));
  EXPECT_EQ(q.take().size(), 2u);
}

TEST(NotificationQueue, WaitReturnsWhenOneArrivesOrAtTheTimeout) {
  NotificationQueue q;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(q.wait(30ms).empty());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 25ms);
  std::thread pusher([&] {
    std::this_thread::sleep_for(20ms);
    q.push(7, Payload(1, 8));
  });
  auto got = q.wait(10s);
  pusher.join();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].peer, 7u);
}

TEST(NotificationQueue, ManyThreadsPushingNeverPassTheBound) {
  NotificationQueue q(64 * 1024);
  std::vector<std::thread> threads;
  std::atomic<uint64_t> kept{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        if (q.push(static_cast<PeerId>(t + 1), Payload(i, 1 + (i * 7919) % 500))) ++kept;
        if (i % 500 == 0) {
          EXPECT_LE(q.queued_bytes(), 64u * 1024);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(q.queued_bytes(), 64u * 1024);
  EXPECT_EQ(kept.load() + q.dropped(), 8000u);
  EXPECT_EQ(q.take().size(), kept.load());
}

}  // namespace
}  // namespace ferry
