// Small transfers between two processes, completed by a caller that polls:
// over shm the waiting thread (wait) or the testing thread (test) reads the
// connection's socket itself (shm.caller_polls) and the target keeps polling
// after each request it served (shm.busy_poll_us). Every byte is checked on
// the target (ferry_test_peer's checksum) after a write and locally after a
// read, with the bytes around each transfer checked untouched. Runs with the
// automatic transport choice (shm by cross-memory attach), with tcp forced
// and with shm in staging mode.
#include <atomic>
#include <barrier>
#include <random>
#include <thread>

#include "fixture.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;

constexpr uint8_t kPoison = 0xA5;

// Polls test() without sleeping, as NIXL's check_xfer_state loop does.
Status SpinUntilDone(Engine& e, TransferId id) {
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  for (;;) {
    Status s = e.test(id);
    if (s.code() != StatusCode::kInProgress) return s;
    if (std::chrono::steady_clock::now() > deadline) {
      return err::Timeout("transfer " + std::to_string(id) + " not done after 30 s of test()");
    }
  }
}

// One write then one read of `size` bytes at `local` <-> peer offset
// `remote`, each completed by wait() (`by_test` false) or by test() polls.
// `target` set: the peer's memory is checked after the write (its checksum
// command; one thread at a time may use it), else only by the read back.
::testing::AssertionResult RoundTrip(Engine& e, PeerId peer, const RemoteDescriptor& rw,
                                     TestPeer* target, uint8_t* local, uint64_t remote,
                                     uint64_t size, uint64_t seed, bool by_test) {
  FillPattern(seed, remote, local, size);
  LocalIov l{local, size};
  RemoteIov r{&rw, remote, size};
  Status s;
  if (by_test) {
    auto id = e.write_async(peer, {&l, 1}, {&r, 1});
    s = id.ok() ? SpinUntilDone(e, *id) : id.status();
  } else {
    s = e.write(peer, {&l, 1}, {&r, 1}, std::nullopt, 30s);
  }
  if (!s.ok()) return ::testing::AssertionFailure() << "write: " << s.to_string();
  if (target != nullptr) {
    auto sum = target->Checksum(remote, size);
    if (!sum || *sum != PatternHash(seed, remote, size)) {
      return ::testing::AssertionFailure()
             << "the target does not hold the " << size << " bytes written at offset " << remote;
    }
  }
  std::memset(local, kPoison, size);
  if (by_test) {
    auto id = e.read_async(peer, {&l, 1}, {&r, 1});
    s = id.ok() ? SpinUntilDone(e, *id) : id.status();
  } else {
    s = e.read(peer, {&l, 1}, {&r, 1}, 30s);
  }
  if (!s.ok()) return ::testing::AssertionFailure() << "read: " << s.to_string();
  size_t bad = 0;
  if (!MatchesPattern(seed, remote, local, size, &bad)) {
    return ::testing::AssertionFailure()
           << "read of " << size << " bytes at offset " << remote << " differs at byte " << bad;
  }
  return ::testing::AssertionSuccess();
}

struct PollCase {
  const char* caller_polls;
  const char* busy_poll_us;
};

void PrintTo(const PollCase& c, std::ostream* os) {
  *os << "shm.caller_polls=" << c.caller_polls << " shm.busy_poll_us=" << c.busy_poll_us;
}

class SmallTransferTest : public ::testing::TestWithParam<PollCase> {};

TEST_P(SmallTransferTest, WritesAndReadsMoveEveryByte) {
  const PollCase c = GetParam();
  constexpr uint64_t kPeerBytes = 4 << 20;
  auto peer = StartPeer({.size = kPeerBytes,
                         .seed = 7,
                         .engine_options = {std::string("shm.caller_polls=") + c.caller_polls,
                                            std::string("shm.busy_poll_us=") + c.busy_poll_us}});
  ASSERT_TRUE(peer);
  auto engine =
      MakeEngine({{"shm.caller_polls", c.caller_polls}, {"shm.busy_poll_us", c.busy_poll_us}});
  ASSERT_TRUE(engine);
  auto pid = engine->connect(ByteView(peer->metadata));
  ASSERT_TRUE(pid.ok()) << pid.status().to_string();
  // Guard bytes on both sides of every local transfer.
  constexpr uint64_t kGuard = 64;
  LocalBuffer buf(*engine, (1 << 20) + 2 * kGuard);
  std::memset(buf.data(), kPoison, buf.size());
  uint8_t* at = buf.data() + kGuard;
  std::mt19937_64 rng(std::hash<std::string>{}(std::string(c.caller_polls) + c.busy_poll_us));
  // 300 KiB: beyond what wait() spins on, so the I/O thread completes it.
  for (uint64_t size :
       {uint64_t{1}, uint64_t{4096}, uint64_t{65536}, uint64_t{65536 + 7}, uint64_t{300 << 10}}) {
    for (int round = 0; round < 12; ++round) {
      SCOPED_TRACE(std::to_string(size) + " B, round " + std::to_string(round));
      // A pause now and then: the next request finds the target asleep.
      if (round % 4 == 3) std::this_thread::sleep_for(2ms);
      const uint64_t remote = rng() % (kPeerBytes - size);
      ASSERT_TRUE(
          RoundTrip(*engine, *pid, peer->rw, peer.get(), at, remote, size, rng(), round % 2 == 1));
      for (uint64_t k = 0; k < kGuard; ++k) {
        ASSERT_EQ(buf.data()[k], kPoison) << "guard byte " << k << " before the buffer";
        ASSERT_EQ(at[size + k], kPoison) << "guard byte " << k << " after " << size << " bytes";
      }
      std::memset(at, kPoison, size);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(PollSettings, SmallTransferTest,
                         ::testing::Values(PollCase{"true", "50"}, PollCase{"true", "0"},
                                           PollCase{"false", "0"}, PollCase{"false", "2000"}),
                         [](const ::testing::TestParamInfo<PollCase>& param_info) {
                           const PollCase& c = param_info.param;
                           return std::string(c.caller_polls[0] == 't' ? "CallerPolls"
                                                                       : "IoThread") +
                                  "_BusyPoll" + c.busy_poll_us + "us";
                         });

// Several threads wait on and test small transfers over one connection while
// the peer writes to and reads from this process over it: whichever thread
// reads the socket (a waiter or the I/O thread) hands every answer to its
// transfer and serves the peer's requests, each byte where it belongs.
TEST(SmallTransferConcurrency, ManyWaitersShareOneConnectionWhileThePeerInitiates) {
  constexpr int kThreads = 4;
  constexpr int kIters = 150;
  constexpr uint64_t kRange = 128 << 10;
  auto peer = StartPeer({.size = kThreads * kRange + (1 << 20), .seed = 9});
  ASSERT_TRUE(peer);
  auto engine = MakeEngine();
  ASSERT_TRUE(engine);
  auto pid = engine->connect(ByteView(peer->metadata));
  ASSERT_TRUE(pid.ok()) << pid.status().to_string();
  // Memory the peer writes into and reads from. Its commands use the same
  // offset on both sides, so it uses only offsets past the threads' ranges
  // of its own memory.
  constexpr uint64_t kFirst = kThreads * kRange;
  constexpr uint64_t kMine = kFirst + (1 << 20);
  LocalBuffer mine(*engine, kMine);
  FillPattern(77, 0, mine.data(), kMine);
  auto desc = engine->advertise(mine.region());
  ASSERT_TRUE(desc.ok()) << desc.status().to_string();
  ASSERT_EQ(peer->Command("connect " + ToHex(engine->metadata())), "OK " + Hex64(engine->id()));

  LocalBuffer buf(*engine, kThreads * kRange);
  std::atomic<int> failures{0};
  uint64_t last[kThreads][3] = {};  // per thread: its last write's seed, offset, size
  std::barrier start(kThreads + 1);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      uint8_t* local = buf.data() + t * kRange;
      start.arrive_and_wait();
      for (int k = 0; k < kIters && failures.load() == 0; ++k) {
        const uint64_t size = 1 + rng() % (64 << 10);
        const uint64_t remote = t * kRange + rng() % (kRange - size);
        const uint64_t seed = rng();
        auto ok = RoundTrip(*engine, *pid, peer->rw, nullptr, local, remote, size, seed, k % 2);
        if (!ok) {
          ADD_FAILURE() << "thread " << t << ", transfer " << k << ": " << ok.message();
          failures++;
        }
        last[t][0] = seed;
        last[t][1] = remote;
        last[t][2] = size;
      }
    });
  }
  // Meanwhile the peer initiates: writes of fresh patterns into our memory,
  // each checked here, and reads of it, each checked by its hash.
  const std::string me = Hex64(engine->id());
  const std::string d = ToHex(desc->to_bytes());
  std::mt19937_64 rng(5);
  start.arrive_and_wait();
  for (int k = 0; k < 60 && failures.load() == 0; ++k) {
    const uint64_t size = 1 + rng() % (64 << 10);
    const uint64_t off = kFirst + rng() % (kMine - kFirst - size);
    const uint64_t seed = 9000 + k;
    ASSERT_EQ(peer->Command("write " + me + " " + d + " " + std::to_string(off) + " " +
                            std::to_string(size) + " " + std::to_string(seed)),
              "OK");
    size_t bad = 0;
    EXPECT_TRUE(MatchesPattern(seed, off, mine.data() + off, size, &bad))
        << "peer's write " << k << " of " << size << " bytes differs at byte " << bad;
    EXPECT_EQ(peer->Command("read " + me + " " + d + " " + std::to_string(off) + " " +
                            std::to_string(size)),
              "OK " + Hex64(PatternHash(seed, off, size)));
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  // The target's own memory holds each thread's last write.
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(peer->Checksum(last[t][1], last[t][2]),
              PatternHash(last[t][0], last[t][1], last[t][2]))
        << "thread " << t << "'s last write of " << last[t][2] << " bytes at " << last[t][1];
  }
}

TEST(SmallTransferOptions, BadValuesAreRefusedNamingTheOption) {
  for (auto [name, bad] : {std::pair{"shm.busy_poll_us", "soon"},
                           {"shm.busy_poll_us", "-1"},
                           {"shm.busy_poll_us", "100001"},
                           {"shm.caller_polls", "maybe"}}) {
    EngineConfig c;
    c.listen = "127.0.0.1:0";
    c.options = {{name, bad}};
    auto e = Engine::create(c);
    ASSERT_FALSE(e.ok()) << name << "=" << bad << " was accepted";
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << e.status().to_string();
    EXPECT_NE(e.status().message().find(name), std::string::npos) << e.status().to_string();
  }
}

}  // namespace
}  // namespace ferry::itest
