// The transfer table (an open-addressing table keyed by id): lookups,
// erasure in any order, growth and shrinking, and transfers made on one
// thread and dropped on another (their blocks come from per-thread caches).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "core/transfer.h"

namespace ferry {
namespace {

TEST(TransferTable, FindsEveryLiveIdAndNoOther) {
  TransferTable table;
  std::vector<TransferId> ids;
  for (int i = 0; i < 1000; ++i) ids.push_back(table.create(TransferOp::kWrite, 1)->id());
  EXPECT_EQ(table.size(), 1000u);
  EXPECT_EQ(table.find(0), nullptr);
  EXPECT_EQ(table.find(ids.back() + 1), nullptr);
  std::mt19937 rng(7);
  std::shuffle(ids.begin(), ids.end(), rng);
  // Erase half in random order (growth, then shrinking, with entries
  // shifted back across the table's end); the rest stays findable.
  for (size_t i = 0; i < 500; ++i) {
    table.erase(ids[i]);
    EXPECT_EQ(table.find(ids[i]), nullptr);
  }
  EXPECT_EQ(table.size(), 500u);
  for (size_t i = 500; i < ids.size(); ++i) {
    auto t = table.find(ids[i]);
    ASSERT_NE(t, nullptr) << ids[i];
    EXPECT_EQ(t->id(), ids[i]);
  }
  for (size_t i = 500; i < ids.size(); ++i) table.erase(ids[i]);
  EXPECT_EQ(table.size(), 0u);
  table.erase(ids[0]);  // unknown: nothing happens
  EXPECT_EQ(table.size(), 0u);
}

TEST(TransferTable, ASlidingWindowWithStragglers) {
  // The usual pattern (a window of calls in flight, the oldest finishing
  // first) with a few transfers nobody waits for, whose home slots the
  // window keeps running over.
  TransferTable table;
  std::vector<TransferId> stragglers, window;
  for (int i = 0; i < 20000; ++i) {
    const TransferId id = table.create(TransferOp::kWrite, 1)->id();
    if (i % 997 == 0) {
      stragglers.push_back(id);
    } else {
      window.push_back(id);
    }
    if (window.size() > 16) {
      bool taken = false;
      auto t = table.find(window.front(), &taken);
      ASSERT_NE(t, nullptr);
      EXPECT_FALSE(taken);
      t->complete(Status::Ok());
      t = table.find(window.front(), &taken);
      ASSERT_NE(t, nullptr);
      EXPECT_TRUE(taken);
      EXPECT_EQ(table.find(window.front()), nullptr);
      window.erase(window.begin());
    }
  }
  EXPECT_EQ(table.size(), window.size() + stragglers.size());
  for (TransferId id : stragglers) EXPECT_NE(table.find(id), nullptr) << id;
  for (TransferId id : window) EXPECT_NE(table.find(id), nullptr) << id;
  table.fail_all(err::Cancelled("engine shut down"));
  for (TransferId id : stragglers) {
    EXPECT_EQ(table.find(id)->status().code(), StatusCode::kCancelled);
  }
}

TEST(TransferTable, TransfersMadeOnOneThreadAndDroppedOnAnother) {
  TransferTable table;
  for (int round = 0; round < 20; ++round) {
    std::vector<std::shared_ptr<Transfer>> made;
    for (int i = 0; i < 200; ++i) made.push_back(table.create(TransferOp::kRead, 2));
    for (auto& t : made) table.erase(t->id());
    std::thread([&made] { made.clear(); }).join();
  }
  EXPECT_EQ(table.size(), 0u);
}

}  // namespace
}  // namespace ferry
