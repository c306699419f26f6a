// SpinWindow (src/core/spin_window.h): an I/O thread polls during the window
// an event armed, and stops for a while when polling would take a core that
// other threads need.
#include "core/spin_window.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace ferry {
namespace {

using Clock = SpinWindow::Clock;
using std::chrono::microseconds;

// Plenty of CPUs: the crowd check never stops these.
constexpr uint32_t kManyCpus = 1u << 20;

TEST(SpinWindowTest, PollsOnlyInsideTheArmedWindow) {
  SpinWindow w(kManyCpus);
  const auto t0 = Clock::now();
  EXPECT_FALSE(w.spinning(t0)) << "nothing armed yet";
  w.arm(t0, microseconds(100));
  EXPECT_TRUE(w.spinning(t0));
  EXPECT_TRUE(w.spinning(t0 + microseconds(99)));
  EXPECT_FALSE(w.spinning(t0 + microseconds(100)));
  // A shorter window armed later does not cut the longer one short.
  w.arm(t0 + microseconds(10), microseconds(20));
  EXPECT_TRUE(w.spinning(t0 + microseconds(50)));
  w.arm(t0 + microseconds(90), microseconds(100));
  EXPECT_TRUE(w.spinning(t0 + microseconds(150)));
  EXPECT_EQ(w.backoffs(), 0u);
}

TEST(SpinWindowTest, ARoundThatLastedPastOneSystemCallStopsPollingForTheBackoff) {
  SpinWindow w(kManyCpus);
  const auto t0 = Clock::now();
  w.arm(t0, std::chrono::seconds(10));
  // An idle round of 10 us: one system call; polling goes on.
  w.idle_round(t0, t0 + microseconds(10));
  EXPECT_TRUE(w.spinning(t0 + microseconds(11)));
  EXPECT_EQ(w.backoffs(), 0u);
  // One of 2 ms: the thread was descheduled.
  const auto t1 = t0 + microseconds(20);
  const auto t2 = t1 + std::chrono::milliseconds(2);
  w.idle_round(t1, t2);
  EXPECT_EQ(w.backoffs(), 1u);
  EXPECT_FALSE(w.spinning(t2)) << "the window it was in is over";
  // Armed again during the backoff: still asleep until it ends.
  w.arm(t2, std::chrono::seconds(10));
  EXPECT_FALSE(w.spinning(t2 + SpinWindow::kBackoff - microseconds(1)));
  EXPECT_TRUE(w.spinning(t2 + SpinWindow::kBackoff));
}

TEST(SpinWindowTest, RunnableThreadsCountsThisOne) {
  const int r = runnable_threads();
  ASSERT_GE(r, 1) << "/proc/loadavg unreadable or this thread not counted as running";
}

// More runnable threads than CPUs + 1 (this process told it has one CPU, and
// three threads spinning beside the test's): the window stops polling.
TEST(SpinWindowTest, ACrowdedMachineStopsPolling) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> hogs;
  for (int i = 0; i < 3; ++i) {
    hogs.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  }
  SpinWindow w(1);
  bool stopped = false;
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  // A loaded machine may deschedule a hog at the moment of a check: try a
  // few windows (each check is at most every kCrowdCheck).
  while (!stopped && Clock::now() < deadline) {
    const auto now = Clock::now();
    w.arm(now, std::chrono::seconds(1));
    if (!w.spinning(now)) stopped = true;
    std::this_thread::sleep_for(SpinWindow::kCrowdCheck + SpinWindow::kBackoff);
  }
  stop = true;
  for (auto& t : hogs) t.join();
  EXPECT_TRUE(stopped) << "never saw more than 2 runnable threads with 4 running";
  EXPECT_GE(w.backoffs(), 1u);
}

}  // namespace
}  // namespace ferry
