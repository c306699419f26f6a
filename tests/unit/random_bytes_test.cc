// Random bytes from getrandom(2) (core/random_bytes.h): buffers of every size
// filled, draws independent, and signals arriving mid-draw (EINTR and short
// reads) retried rather than failing or leaving a tail unwritten.
#include "core/random_bytes.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/time.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <set>
#include <vector>

namespace ferry {
namespace {

TEST(RandomBytes, NothingAsked) {
  EXPECT_TRUE(random_bytes(nullptr, 0).ok());
}

// Every byte of the buffer is written: a buffer pre-set to one value cannot
// keep it in any aligned 16-byte block (probability 2^-128 per block).
void ExpectAllWritten(size_t n) {
  for (uint8_t fill : {uint8_t{0x00}, uint8_t{0xff}}) {
    std::vector<uint8_t> buf(n, fill);
    const Status s = random_bytes(buf.data(), buf.size());
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (size_t at = 0; at + 16 <= n; at += 16) {
      ASSERT_FALSE(std::all_of(buf.begin() + at, buf.begin() + at + 16,
                               [&](uint8_t b) { return b == fill; }))
          << n << " bytes: block at " << at << " left as " << int{fill};
    }
  }
}

TEST(RandomBytes, FillsBuffersOfEverySize) {
  for (size_t n : {16, 32, 255, 256, 257, 4096, 1 << 20}) ExpectAllWritten(n);
}

TEST(RandomBytes, MoreThanOneCallReturns) {
  // getrandom gives at most 32 MiB - 1 bytes per call: this takes two.
  ExpectAllWritten((size_t{32} << 20) + 4096);
}

TEST(RandomBytes, LooksUniform) {
  std::vector<uint8_t> buf(1 << 20);
  ASSERT_TRUE(random_bytes(buf.data(), buf.size()).ok());
  std::array<size_t, 256> count{};
  for (uint8_t b : buf) ++count[b];
  // 4096 expected per value; a standard deviation is 64.
  for (int v = 0; v < 256; ++v) {
    EXPECT_GT(count[v], 4096u - 640u) << "value " << v;
    EXPECT_LT(count[v], 4096u + 640u) << "value " << v;
  }
}

TEST(RandomBytes, NonzeroU64sAreDistinct) {
  std::set<uint64_t> seen;
  for (int i = 0; i < 1000; ++i) {
    auto v = random_nonzero_u64();
    ASSERT_TRUE(v.ok()) << v.status().to_string();
    EXPECT_NE(*v, 0u);
    seen.insert(*v);
  }
  EXPECT_EQ(seen.size(), 1000u);
}

std::atomic<int> g_signals{0};
void on_alarm(int) {
  g_signals.fetch_add(1, std::memory_order_relaxed);
}

TEST(RandomBytes, SignalsMidDrawAreRetried) {
  // SIGALRM every 50 us, handled without SA_RESTART: large draws are cut
  // short or fail with EINTR inside getrandom, and random_bytes goes on.
  struct sigaction sa {};
  sa.sa_handler = on_alarm;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;
  struct sigaction old {};
  ASSERT_EQ(sigaction(SIGALRM, &sa, &old), 0);
  itimerval tick{{0, 50}, {0, 50}};
  ASSERT_EQ(setitimer(ITIMER_REAL, &tick, nullptr), 0);
  for (int i = 0; i < 8; ++i) ExpectAllWritten(size_t{4} << 20);
  itimerval off{};
  setitimer(ITIMER_REAL, &off, nullptr);
  sigaction(SIGALRM, &old, nullptr);
  EXPECT_GT(g_signals.load(), 0);
}

}  // namespace
}  // namespace ferry
