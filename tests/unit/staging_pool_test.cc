// The staging pool's free list and waiter queue (no device needed: the pool
// is laid over ordinary memory).
#include "cuda/staging_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace ferry {
namespace {

constexpr size_t kSlot = 4096;

TEST(StagingPool, HandsOutEverySlotOnceThenQueues) {
  std::vector<uint8_t> memory(3 * kSlot);
  auto pool = StagingPool::over(memory.data(), kSlot, 3);
  std::vector<std::unique_ptr<StagingSlot>> held;
  for (int i = 0; i < 3; ++i) {
    auto s = pool->acquire_or_queue([](std::unique_ptr<StagingSlot>) { FAIL() << "queued"; });
    ASSERT_NE(s, nullptr);
    held.push_back(std::move(s));
  }
  std::vector<uint8_t*> seen;
  for (auto& s : held) seen.push_back(s->data());
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::unique(seen.begin(), seen.end()), seen.end()) << "a slot was handed out twice";
  for (uint8_t* p : seen) {
    EXPECT_TRUE(p >= memory.data() && p + kSlot <= memory.data() + memory.size());
    EXPECT_EQ((p - memory.data()) % kSlot, 0);
  }
  EXPECT_EQ(pool->free_slots(), 0u);

  std::unique_ptr<StagingSlot> got;
  EXPECT_EQ(pool->acquire_or_queue([&](std::unique_ptr<StagingSlot> s) { got = std::move(s); }),
            nullptr);
  EXPECT_EQ(pool->waiters(), 1u);
  uint8_t* freed = held[1]->data();
  held[1].reset();  // goes straight to the waiter, not to the free list
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->data(), freed);
  EXPECT_EQ(pool->free_slots(), 0u);
  EXPECT_EQ(pool->waiters(), 0u);
}

TEST(StagingPool, WaitersAreServedInOrderAndNoneIsOvertaken) {
  std::vector<uint8_t> memory(2 * kSlot);
  auto pool = StagingPool::over(memory.data(), kSlot, 2);
  auto a = pool->acquire_or_queue(nullptr);
  auto b = pool->acquire_or_queue(nullptr);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  std::vector<int> order;
  std::vector<std::unique_ptr<StagingSlot>> given;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(pool->acquire_or_queue([&, i](std::unique_ptr<StagingSlot> s) {
      order.push_back(i);
      given.push_back(std::move(s));
    }),
              nullptr);
  }
  a.reset();
  b.reset();
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
  // Waiter 2 still queued: a newcomer must queue behind it even once a slot
  // is free again.
  given[0].reset();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  given[1].reset();
  EXPECT_EQ(pool->free_slots(), 1u);
  auto c = pool->acquire_or_queue(nullptr);
  EXPECT_NE(c, nullptr) << "a free slot with nobody waiting is handed out at once";
}

TEST(StagingPool, LastReleasedSlotIsReusedFirst) {
  std::vector<uint8_t> memory(4 * kSlot);
  auto pool = StagingPool::over(memory.data(), kSlot, 4);
  auto a = pool->acquire_or_queue(nullptr);
  uint8_t* p = a->data();
  a.reset();
  auto again = pool->acquire_or_queue(nullptr);
  EXPECT_EQ(again->data(), p) << "the warm slot should come back first";
}

TEST(StagingPool, DroppedWaitersAreNotCalled) {
  std::vector<uint8_t> memory(kSlot);
  auto pool = StagingPool::over(memory.data(), kSlot, 1);
  auto a = pool->acquire_or_queue(nullptr);
  bool called = false;
  EXPECT_EQ(pool->acquire_or_queue([&](std::unique_ptr<StagingSlot>) { called = true; }), nullptr);
  pool->drop_waiters();
  a.reset();
  EXPECT_FALSE(called);
  EXPECT_EQ(pool->free_slots(), 1u);
}

// Eight threads take 2,000 slots each from a pool of three, through the
// waiter queue when none is free, and stamp every byte of the slot while
// holding it: a slot handed to two holders at once shows as a torn stamp.
TEST(StagingPool, ConcurrentHoldersNeverShareASlot) {
  constexpr int kThreads = 8, kRounds = 2000;
  std::vector<uint8_t> memory(3 * kSlot);
  auto pool = StagingPool::over(memory.data(), kSlot, 3);
  std::atomic<int> torn{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mutex mu;
      std::condition_variable cv;
      std::deque<std::unique_ptr<StagingSlot>> inbox;
      for (int r = 0; r < kRounds; ++r) {
        auto slot = pool->acquire_or_queue([&](std::unique_ptr<StagingSlot> s) {
          std::lock_guard lock(mu);
          inbox.push_back(std::move(s));
          cv.notify_one();
        });
        if (!slot) {
          std::unique_lock lock(mu);
          cv.wait(lock, [&] { return !inbox.empty(); });
          slot = std::move(inbox.front());
          inbox.pop_front();
        }
        const auto stamp = static_cast<uint8_t>(t * 31 + r);
        std::memset(slot->data(), stamp, kSlot);
        std::this_thread::yield();
        for (size_t i = 0; i < kSlot; i += 257) {
          if (slot->data()[i] != stamp) {
            torn.fetch_add(1);
            break;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(torn.load(), 0);
  EXPECT_EQ(pool->free_slots(), 3u);
  EXPECT_EQ(pool->waiters(), 0u);
}

}  // namespace
}  // namespace ferry
