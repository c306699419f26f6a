// Small requests through the shm request ring (shm.request_ring on both
// engines) between two processes, in both shm modes (cross-memory attach and
// staging): a burst larger than the ring (the rest goes on the socket, none
// lost), notifications after their data and in order across ring and socket,
// deregistration while ring requests flow (later ones refused NotFound), and
// the target killed while a ring request waits. Every byte is checked, with
// guard bytes around each local transfer. The ring is the default, so the
// conformance suites run with it; their /shm-socket variants run without
// (tests/integration/CMakeLists.txt).
#include <signal.h>

#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "fixture.h"
#include "stopped_process.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;

constexpr uint8_t kPoison = 0x5A;

uint64_t Counter(const Engine& e, const std::string& name) {
  for (const auto& t : e.transports()) {
    if (t.name != "shm") continue;
    for (const auto& [n, v] : t.counters) {
      if (n == name) return v;
    }
  }
  return 0;
}

class RequestRingTest : public ::testing::TestWithParam<const char*> {
 protected:
  std::unique_ptr<TestPeer> Peer(uint64_t size, uint64_t seed) {
    return StartPeer(
        {.size = size,
         .seed = seed,
         .engine_options = {"shm.request_ring=true", std::string("shm.mode=") + GetParam()}});
  }
  std::unique_ptr<Engine> Local(std::map<std::string, std::string> more = {}) {
    more["shm.request_ring"] = "true";
    more["shm.mode"] = GetParam();
    return MakeEngine(more);
  }
};

INSTANTIATE_TEST_SUITE_P(Modes, RequestRingTest, ::testing::Values("auto", "staging"),
                         [](const ::testing::TestParamInfo<const char*>& p) {
                           return std::string(p.param);
                         });

// 600 small writes posted at once (the ring has 128 slots): those that find
// no free slot go on the socket, and then ring and socket share the work;
// every byte arrives. The same for reads, into guarded local memory.
TEST_P(RequestRingTest, ABurstLargerThanTheRingLosesNothing) {
  constexpr int kCount = 600;
  constexpr uint64_t kStride = 4096;
  constexpr uint64_t kPeerBytes = kCount * kStride;
  auto peer = Peer(kPeerBytes, 21);
  ASSERT_TRUE(peer);
  auto engine = Local();
  ASSERT_TRUE(engine);
  auto pid = engine->connect(ByteView(peer->metadata));
  ASSERT_TRUE(pid.ok()) << pid.status().to_string();
  constexpr uint64_t kGuard = 64;
  LocalBuffer src(*engine, kPeerBytes);
  LocalBuffer dst(*engine, kPeerBytes + 2 * kGuard);
  std::mt19937_64 rng(4);
  std::vector<uint64_t> sizes(kCount), seeds(kCount);
  std::vector<TransferId> ids;
  for (int i = 0; i < kCount; ++i) {
    sizes[i] = 1 + rng() % kStride;
    seeds[i] = rng();
    FillPattern(seeds[i], i * kStride, src.data() + i * kStride, sizes[i]);
    LocalIov l{src.data() + i * kStride, sizes[i]};
    RemoteIov r{&peer->rw, i * kStride, sizes[i]};
    auto id = engine->write_async(*pid, {&l, 1}, {&r, 1});
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  for (TransferId id : ids) ASSERT_TRUE(engine->wait(id, 30s).ok()) << "write " << id;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (int i = 0; i < kCount; ++i) ranges.emplace_back(i * kStride, sizes[i]);
  auto sums = peer->Checksums(ranges);
  ASSERT_TRUE(sums);
  for (int i = 0; i < kCount; ++i) {
    ASSERT_EQ((*sums)[i], PatternHash(seeds[i], i * kStride, sizes[i])) << "write " << i;
  }
  std::memset(dst.data(), kPoison, dst.size());
  uint8_t* at = dst.data() + kGuard;
  ids.clear();
  for (int i = 0; i < kCount; ++i) {
    LocalIov l{at + i * kStride, sizes[i]};
    RemoteIov r{&peer->rw, i * kStride, sizes[i]};
    auto id = engine->read_async(*pid, {&l, 1}, {&r, 1});
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  for (TransferId id : ids) ASSERT_TRUE(engine->wait(id, 30s).ok()) << "read " << id;
  for (int i = 0; i < kCount; ++i) {
    size_t bad = 0;
    ASSERT_TRUE(MatchesPattern(seeds[i], i * kStride, at + i * kStride, sizes[i], &bad))
        << "read " << i << " differs at byte " << bad;
    for (uint64_t k = sizes[i]; k < kStride; ++k) {
      ASSERT_EQ(at[i * kStride + k], kPoison) << "read " << i << " wrote past its end at " << k;
    }
  }
  for (uint64_t k = 0; k < kGuard; ++k) {
    ASSERT_EQ(dst.data()[k], kPoison);
    ASSERT_EQ(at[kPeerBytes + k], kPoison);
  }
  EXPECT_GT(Counter(*engine, "ring_posted"), 0u) << "nothing went through the ring";
}

// Writes with notifications of every size class -- ring (<= 64 KiB), socket
// (300 KiB) and two requests (2 MiB, with shm.max_request_bytes=1MiB) --
// posted without waiting, each into its own range: the target sees each
// notification only once its write's bytes are in place. Then standalone
// notifications between such writes arrive in call order.
TEST_P(RequestRingTest, NotificationsFollowTheirDataAndKeepTheirOrder) {
  constexpr uint64_t kSlot = 2 << 20;
  constexpr int kWrites = 20;
  constexpr uint64_t kPeerBytes = kWrites * kSlot;
  auto peer = Peer(kPeerBytes, 22);
  ASSERT_TRUE(peer);
  auto engine = Local({{"shm.max_request_bytes", "1MiB"}});
  ASSERT_TRUE(engine);
  auto pid = engine->connect(ByteView(peer->metadata));
  ASSERT_TRUE(pid.ok()) << pid.status().to_string();
  LocalBuffer src(*engine, kPeerBytes);
  std::mt19937_64 rng(8);
  const uint64_t kSizes[] = {1, 4096, 65536, 300 << 10, kSlot};
  ASSERT_EQ(peer->Command("watch " + std::to_string(kWrites) + " 60000"), "WATCHING");
  std::vector<TransferId> ids;
  for (int i = 0; i < kWrites; ++i) {
    const uint64_t size = kSizes[i % 5];
    const uint64_t off = i * kSlot + rng() % (kSlot - size + 1);
    FillPattern(rng(), off, src.data() + off, size);
    const std::string note = std::to_string(off) + " " + std::to_string(size) + " " +
                             Hex64(HashBytes(src.data() + off, size));
    LocalIov l{src.data() + off, size};
    RemoteIov r{&peer->rw, off, size};
    auto id =
        engine->write_async(*pid, {&l, 1}, {&r, 1},
                            ByteView(reinterpret_cast<const uint8_t*>(note.data()), note.size()));
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  for (TransferId w : ids) ASSERT_TRUE(engine->wait(w, 30s).ok());
  auto watched = peer->process().ReadLine(60s);
  ASSERT_TRUE(watched);
  EXPECT_EQ(*watched, "OK received=" + std::to_string(kWrites) +
                          " good=" + std::to_string(kWrites) + " bad=0");

  // Standalone notifications, each after an async write of some size class.
  constexpr int kNotes = 30;
  ids.clear();
  for (int i = 0; i < kNotes; ++i) {
    const uint64_t size = kSizes[(i + rng() % 2) % 5];
    LocalIov l{src.data(), size};
    RemoteIov r{&peer->rw, 0, size};
    auto id = engine->write_async(*pid, {&l, 1}, {&r, 1});
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
    const std::string note = "n" + std::to_string(i);
    ASSERT_TRUE(
        engine->notify(*pid, ByteView(reinterpret_cast<const uint8_t*>(note.data()), note.size()))
            .ok());
  }
  for (TransferId w : ids) ASSERT_TRUE(engine->wait(w, 30s).ok());
  auto got = Split(peer->Command("notifications " + std::to_string(kNotes) + " 20000"));
  ASSERT_EQ(got.size(), static_cast<size_t>(kNotes + 2)) << "OK <count> <notes...>";
  for (int i = 0; i < kNotes; ++i) {
    const std::string want = "n" + std::to_string(i);
    const std::string hex = got[2 + i].substr(got[2 + i].find(':') + 1);
    EXPECT_EQ(hex, ToHex(reinterpret_cast<const uint8_t*>(want.data()), want.size()))
        << "notification " << i << " out of order";
  }
}

// Two threads write small blocks through the ring without pause while the
// target deregisters its region: every write that started after
// deregister_memory() returned is refused NotFound, naming the region, and
// none of them changed a byte.
TEST_P(RequestRingTest, DeregistrationRefusesLaterRingRequests) {
  constexpr uint64_t kPeerBytes = 1 << 20;
  auto peer = Peer(kPeerBytes, 23);
  ASSERT_TRUE(peer);
  auto engine = Local();
  ASSERT_TRUE(engine);
  auto pid = engine->connect(ByteView(peer->metadata));
  ASSERT_TRUE(pid.ok()) << pid.status().to_string();
  // Before the deregistration the threads write one pattern, after it
  // another: any late write that landed would show.
  LocalBuffer src(*engine, 2 * 4096), late_src(*engine, 2 * 4096);
  FillPattern(31, 0, src.data(), 2 * 4096);
  FillPattern(32, 0, late_src.data(), 2 * 4096);
  std::atomic<bool> revoked{false};
  std::atomic<int> ok_before[2] = {0, 0};
  std::atomic<int> refused_after{0}, wrong_after{0};
  std::string first_wrong;
  std::mutex wrong_mu;
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      LocalIov early{src.data() + t * 4096, 4096};
      LocalIov late_l{late_src.data() + t * 4096, 4096};
      RemoteIov r{&peer->rw, t * 4096u, 4096};
      for (int after = 0; after < 200;) {
        const bool late = revoked.load();
        Status s = engine->write(*pid, {late ? &late_l : &early, 1}, {&r, 1}, std::nullopt, 10s);
        if (!late) {
          if (s.ok()) ok_before[t]++;
          continue;
        }
        ++after;
        if (s.code() == StatusCode::kNotFound &&
            s.message().find("region " + std::to_string(peer->region)) != std::string::npos) {
          refused_after++;
        } else {
          wrong_after++;
          std::lock_guard lock(wrong_mu);
          if (first_wrong.empty()) first_wrong = s.to_string();
        }
      }
    });
  }
  // Each thread's block holds its early bytes before the deregistration.
  while (ok_before[0].load() < 5 || ok_before[1].load() < 5) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(peer->Command("dereg"), "OK");
  revoked.store(true);
  for (auto& th : threads) th.join();
  EXPECT_EQ(refused_after.load(), 400);
  EXPECT_EQ(wrong_after.load(), 0) << first_wrong;
  // Only the early pattern is there.
  EXPECT_EQ(peer->Checksum(0, 2 * 4096), PatternHash(31, 0, 2 * 4096))
      << "a write posted after deregistration changed the region";
}

// The target stops (SIGSTOP) with ring requests posted, then is killed:
// they fail with PeerDisconnected within 2 s of its death.
TEST_P(RequestRingTest, TargetKilledWhileARingRequestWaits) {
  auto peer = Peer(1 << 20, 24);
  ASSERT_TRUE(peer);
  auto engine = Local();
  ASSERT_TRUE(engine);
  auto pid = engine->connect(ByteView(peer->metadata));
  ASSERT_TRUE(pid.ok()) << pid.status().to_string();
  LocalBuffer src(*engine, 1 << 16);
  LocalIov l{src.data(), 4096};
  RemoteIov r{&peer->rw, 0, 4096};
  ASSERT_TRUE(engine->write(*pid, {&l, 1}, {&r, 1}, std::nullopt, 10s).ok());
  peer->process().Kill(SIGSTOP);
  // Every thread of it stopped (a busy-polling target serves a ring request
  // within microseconds, faster than a stop signal reaches all its threads).
  ASSERT_TRUE(WaitAllThreadsStopped(peer->process().pid(), 5s));
  std::vector<TransferId> ids;
  for (int i = 0; i < 8; ++i) {
    auto id = i % 2 == 0 ? engine->write_async(*pid, {&l, 1}, {&r, 1})
                         : engine->read_async(*pid, {&l, 1}, {&r, 1});
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  std::this_thread::sleep_for(50ms);
  for (TransferId id : ids) EXPECT_EQ(engine->test(id).code(), StatusCode::kInProgress);
  peer->process().Kill(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  for (TransferId id : ids) {
    Status s = engine->wait(id, 5s);
    EXPECT_EQ(s.code(), StatusCode::kPeerDisconnected) << s.to_string();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 2s);
}

}  // namespace
}  // namespace ferry::itest
