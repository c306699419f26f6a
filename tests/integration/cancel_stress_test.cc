// Cancel under load: no frame of a cancelled write may land on the target
// after a write posted once cancel() returned.
//
// TransferTest.CancelledWriteNeverOverwritesALaterWrite checks one cancelled
// write and one later write per round on an idle machine. A race of this kind
// showed only under load (gpu.two_gpus.TcpGpuCancel failed at round 89 under
// `ctest -j4`, never alone), so this test makes the schedule as uneven as it
// can: 8 streams and 4 I/O threads on both sides, small frames (so every
// stream carries frames of every write), two large writes cancelled together
// at a random moment, eight later writes of random sizes and batches posted
// back to back after cancel() returns, and processes spinning on every CPU
// meanwhile. Every byte of every later write is checked at the target (a
// hash) and read back.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "fixture.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;

// Processes that spin on every CPU until destroyed, so that I/O threads of
// both engines are preempted at arbitrary points. Started before any engine
// (fork from a process without threads) and killed by their pids.
class CpuLoad {
 public:
  explicit CpuLoad(unsigned n) {
    for (unsigned i = 0; i < n; ++i) {
      const pid_t pid = fork();
      if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives a crashed test
        volatile uint64_t x = 0;
        for (;;) x = x + 1;
      }
      if (pid > 0) pids_.push_back(pid);
    }
  }
  ~CpuLoad() {
    for (pid_t pid : pids_) kill(pid, SIGKILL);
    for (pid_t pid : pids_) waitpid(pid, nullptr, 0);
  }
  size_t size() const { return pids_.size(); }

 private:
  std::vector<pid_t> pids_;
};

// One write posted after cancel(): `iovs` pieces of [offset, offset + bytes)
// of the target's buffer, from the same offsets of a local buffer filled
// with the pattern of `seed`.
struct LaterWrite {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  size_t iovs = 1;
  uint64_t seed = 0;
};

TEST(CancelStress, NoCancelledWriteOverwritesALaterOne) {
  constexpr uint64_t kRange = 4 << 20;  // the target's buffer, written by every write
  constexpr int kBigIovs = 64;          // 256 MiB per cancelled write
  constexpr int kLater = 8;             // later writes per round, one per eighth of the range
  constexpr uint64_t kSlice = kRange / kLater;
  constexpr uint64_t kCancelledSeed = 96;
  CpuLoad load(std::max(2u, std::thread::hardware_concurrency()));
  const std::vector<std::string> peer_options = {"tcp.streams=8", "tcp.io_threads=4",
                                                 "tcp.chunk_bytes=65536"};
  auto peer = StartPeer({.size = kRange, .seed = 42, .engine_options = peer_options});
  ASSERT_TRUE(peer);
  auto engine =
      MakeEngine({{"tcp.streams", "8"}, {"tcp.io_threads", "4"}, {"tcp.chunk_bytes", "65536"}});
  ASSERT_TRUE(engine);
  auto connected = engine->connect(ByteView(peer->metadata));
  ASSERT_TRUE(connected.ok()) << connected.status().to_string();
  const PeerId pid = *connected;

  LocalBuffer big(*engine, kRange);
  FillPattern(kCancelledSeed, 0, big.data(), kRange);
  std::vector<LocalIov> bl(kBigIovs, LocalIov{big.data(), kRange});
  std::vector<RemoteIov> br(kBigIovs, RemoteIov{&peer->rw, 0, kRange});
  LocalBuffer later(*engine, kRange);
  LocalBuffer back(*engine, kRange);

  std::mt19937_64 rng(std::random_device{}());
  const uint64_t run_seed = rng();
  std::printf("random seed %llu, %zu spinning processes\n",
              static_cast<unsigned long long>(run_seed), load.size());
  rng.seed(run_seed);
  auto pick = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };

  const auto end = std::chrono::steady_clock::now() + 6s;
  int rounds = 0, cancelled = 0;
  for (uint64_t seed = 10000; rounds < 400 && std::chrono::steady_clock::now() < end;
       seed += kLater) {
    SCOPED_TRACE("round " + std::to_string(rounds) + " (random seed " + std::to_string(run_seed) +
                 ")");
    ++rounds;
    // Two large writes over the whole range, cancelled together after 0-3 ms.
    TransferId big_ids[2];
    for (auto& id : big_ids) {
      auto posted = engine->write_async(pid, bl, br);
      ASSERT_TRUE(posted.ok()) << posted.status().to_string();
      id = *posted;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(pick(0, 3000)));
    const bool reverse = pick(0, 1) == 1;
    for (int k = 0; k < 2; ++k) ASSERT_TRUE(engine->cancel(big_ids[reverse ? 1 - k : k]).ok());
    for (TransferId id : big_ids) {
      const Status c = engine->wait(id, 30s);
      ASSERT_TRUE(c.code() == StatusCode::kCancelled || c.ok()) << c.to_string();
      if (c.code() == StatusCode::kCancelled) ++cancelled;
    }
    // Later writes: one in each eighth of the range, random size and
    // batch, posted back to back.
    LaterWrite w[kLater];
    TransferId ids[kLater];
    for (int k = 0; k < kLater; ++k) {
      w[k].bytes = pick(1, kSlice);
      w[k].offset = k * kSlice + pick(0, kSlice - w[k].bytes);
      w[k].iovs = static_cast<size_t>(pick(1, std::min<uint64_t>(64, w[k].bytes)));
      w[k].seed = seed + k;
      FillPattern(w[k].seed, 0, later.data() + w[k].offset, w[k].bytes);
      std::vector<LocalIov> l;
      std::vector<RemoteIov> r;
      const uint64_t piece = w[k].bytes / w[k].iovs;
      for (size_t i = 0; i < w[k].iovs; ++i) {
        const uint64_t at = i * piece;
        const uint64_t len = i + 1 == w[k].iovs ? w[k].bytes - at : piece;
        l.push_back({later.data() + w[k].offset + at, len});
        r.push_back({&peer->rw, w[k].offset + at, len});
      }
      auto posted = engine->write_async(pid, l, r);
      ASSERT_TRUE(posted.ok()) << posted.status().to_string();
      ids[k] = *posted;
    }
    for (TransferId id : ids) {
      const Status s = engine->wait(id, 30s);
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    // A late frame of a cancelled write would land within milliseconds
    // (it must not land at all): look after a pause, then again by reading.
    std::this_thread::sleep_for(10ms);
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const LaterWrite& x : w) ranges.emplace_back(x.offset, x.bytes);
    auto sums = peer->Checksums(ranges);
    ASSERT_TRUE(sums.has_value()) << "the target did not answer";
    for (int k = 0; k < kLater; ++k) {
      ASSERT_EQ((*sums)[k], PatternHash(w[k].seed, 0, w[k].bytes))
          << "later write " << k << " ([" << w[k].offset << ", +" << w[k].bytes << "), "
          << w[k].iovs << " iovs) was overwritten at the target"
          << ((*sums)[k] == PatternHash(kCancelledSeed, w[k].offset, w[k].bytes)
                  ? " by a cancelled write's bytes"
                  : " in part");
    }
    for (int k = 0; k < kLater; ++k) {
      std::memset(back.data() + w[k].offset, 0, w[k].bytes);
      LocalIov l{back.data() + w[k].offset, w[k].bytes};
      RemoteIov r{&peer->rw, w[k].offset, w[k].bytes};
      const Status s = engine->read(pid, {&l, 1}, {&r, 1}, 30s);
      ASSERT_TRUE(s.ok()) << s.to_string();
      size_t bad = 0;
      ASSERT_TRUE(MatchesPattern(w[k].seed, 0, back.data() + w[k].offset, w[k].bytes, &bad))
          << "later write " << k << " read back differs at byte " << bad;
    }
  }
  EXPECT_GT(cancelled, 0) << "no round caught a large write before it finished";
  uint64_t held = 0;
  for (const auto& t : engine->transports()) {
    for (const auto& [name, value] : t.counters) {
      if (t.name == "tcp" && name == "fence_held_requests") held = value;
    }
  }
  std::printf(
      "%d rounds, %d of %d large writes cancelled before they finished, %llu requests "
      "held by tcp's cancel fence\n",
      rounds, cancelled, 2 * rounds, static_cast<unsigned long long>(held));
  EXPECT_GT(held, 0u) << "no later write waited behind the cancel fence: the race was not run";
}

}  // namespace
}  // namespace ferry::itest
