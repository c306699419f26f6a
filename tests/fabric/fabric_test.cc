// The fabric transport (libfabric, tested with tcp;ofi_rxm) between real
// processes: every operation with random layouts and every byte checked,
// batch sizes 1 ... 100,000, small operations combined, refusals,
// notification after data, a peer killed mid-transfer, two network
// namespaces, and the library missing.
// Skipped with the reason when fabric cannot start here (no libfabric).
#include <signal.h>
#include <unistd.h>

#include <random>

#include "../integration/fixture.h"
#include "../integration/stopped_process.h"
#include "transport/fabric/fabric_wire.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::vector<std::string> kPeerFabric = {"engine.transports=fabric,tcp"};

std::map<std::string, std::string> FabricOptions() {
  return {{"engine.transports", "fabric,tcp"}};
}

// Why fabric cannot run here, or empty.
std::string FabricUnavailable() {
  EngineConfig c;
  c.listen = "127.0.0.1:0";
  c.options = {{"engine.transports", "fabric"}};
  auto e = Engine::create(c);
  if (!e.ok()) return e.status().to_string();
  return {};
}

#define SKIP_WITHOUT_FABRIC()                                            \
  do {                                                                   \
    static const std::string why = FabricUnavailable();                  \
    if (!why.empty()) GTEST_SKIP() << "fabric cannot run here: " << why; \
  } while (0)

// A fabric counter of `e` (Engine::transports()); 0 if there is none.
uint64_t FabricCounter(const Engine& e, std::string_view name) {
  for (const auto& t : e.transports()) {
    if (t.name != "fabric") continue;
    for (const auto& [n, v] : t.counters) {
      if (n == name) return v;
    }
  }
  return 0;
}

// Waits for each transfer; every one must succeed.
void WaitAllOk(Engine& e, const std::vector<TransferId>& ids) {
  for (TransferId id : ids) {
    Status s = e.wait(id, 60s);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

uint64_t RandomSeed() {
  static std::random_device rd;
  return (uint64_t{rd()} << 32) | rd();
}

class FabricTest : public ::testing::Test {
 protected:
  // A peer of `size` bytes (pattern of seed 77), our engine with `options`
  // on top of FabricOptions(), connected, and a local buffer of `size`.
  void Start(uint64_t size, const std::map<std::string, std::string>& options = {}) {
    size_ = size;
    peer_ = StartPeer({.size = size, .seed = 77, .engine_options = kPeerFabric});
    ASSERT_TRUE(peer_);
    auto all = FabricOptions();
    all.insert(options.begin(), options.end());
    engine_ = MakeEngine(all);
    ASSERT_TRUE(engine_);
    auto p = engine_->connect(ByteView(peer_->metadata));
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    pid_ = *p;
    local_ = std::make_unique<LocalBuffer>(*engine_, size);
  }
  void SetUp() override { SKIP_WITHOUT_FABRIC(); }

  uint64_t size_ = 0;
  std::unique_ptr<TestPeer> peer_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<LocalBuffer> local_;
  PeerId pid_ = 0;
};

TEST_F(FabricTest, CarriesHostMemoryAndSaysSo) {
  Start(1 << 20);
  auto routes = engine_->peer_transports(pid_);
  ASSERT_TRUE(routes.ok()) << routes.status().to_string();
  bool fabric_host = false;
  for (const auto& r : *routes) {
    if (r.transport == "fabric") {
      EXPECT_TRUE(r.connected);
      fabric_host = r.carries.find("host memory") != std::string::npos;
      // With CUDA here it stages local GPU memory and says why the peer's
      // GPU memory is not reachable; without, it carries no GPU memory.
      const bool staged = r.carries.find("local GPU with peer host memory") != std::string::npos;
      EXPECT_NE(r.reason.find(staged ? "does not register GPU memory with FI_HMEM"
                                     : "carries no GPU memory"),
                std::string::npos)
          << r.carries << " / " << r.reason;
    }
  }
  EXPECT_TRUE(fabric_host);
  bool shown = false;
  for (const auto& t : engine_->transports()) {
    if (t.name == "fabric") {
      shown = t.running && t.detail.find("mr_mode") != std::string::npos;
      std::printf("fabric: %s\n", t.detail.c_str());
    }
  }
  EXPECT_TRUE(shown);
  EXPECT_EQ(peer_->Command("carriers " + Hex64(engine_->id())).substr(0, 9), "OK fabric");
}

// Random non-overlapping iovs over [0, size): local offset = remote offset.
std::vector<std::pair<uint64_t, uint64_t>> Layout(size_t n, uint64_t size, std::mt19937_64& rng) {
  const uint64_t slot = size / n;
  std::vector<std::pair<uint64_t, uint64_t>> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t len = 1 + rng() % slot;
    const uint64_t off = i * slot + rng() % (slot - len + 1);
    out.emplace_back(off, len);
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

TEST_F(FabricTest, WriteAndReadEveryBatchSize) {
  constexpr uint64_t kSize = 8 << 20;
  Start(kSize);
  const uint64_t seed = RandomSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> expect(kSize);
  FillPattern(77, 0, expect.data(), kSize);
  for (size_t n : {size_t{1}, size_t{7}, size_t{256}, size_t{1000}, size_t{100000}}) {
    SCOPED_TRACE("batch of " + std::to_string(n));
    auto layout = Layout(n, kSize, rng);
    const uint64_t wseed = rng();
    FillPattern(wseed, 0, local_->data(), kSize);
    std::vector<LocalIov> l;
    std::vector<RemoteIov> r;
    for (auto [off, len] : layout) {
      l.push_back({local_->data() + off, len});
      r.push_back({&peer_->rw, off, len});
      FillPattern(wseed, off, expect.data() + off, len);
    }
    const auto t0 = Clock::now();
    Status s = engine_->write(pid_, l, r, std::nullopt, 120s);
    ASSERT_TRUE(s.ok()) << s.to_string();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    std::printf("write of %zu iovs: %.1f ms\n", n, ms);
    ASSERT_EQ(peer_->Checksum(0, kSize), HashBytes(expect.data(), kSize));
    // Read the same iovs back into zeroed memory: covered bytes hold what
    // the target holds, the gaps stay zero.
    std::memset(local_->data(), 0, kSize);
    s = engine_->read(pid_, l, r, 120s);
    ASSERT_TRUE(s.ok()) << s.to_string();
    std::vector<uint8_t> want(kSize, 0);
    for (auto [off, len] : layout) std::memcpy(want.data() + off, expect.data() + off, len);
    ASSERT_EQ(HashBytes(local_->data(), kSize), HashBytes(want.data(), kSize));
  }
}

TEST_F(FabricTest, LargeWritesAndReadsAndManyInFlight) {
  constexpr uint64_t kSize = 32 << 20;
  Start(kSize);
  const uint64_t seed = RandomSeed();
  FillPattern(seed, 0, local_->data(), kSize);
  LocalIov l{local_->data(), kSize};
  RemoteIov r{&peer_->rw, 0, kSize};
  Status s = engine_->write(pid_, {&l, 1}, {&r, 1}, std::nullopt, 60s);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(peer_->Checksum(0, kSize), PatternHash(seed, 0, kSize));
  // 64 async writes of 512 KiB at once (more than the op window of 16), then
  // reads of each piece.
  auto e = MakeEngine({{"engine.transports", "fabric,tcp"}, {"fabric.max_inflight", "16"}});
  ASSERT_TRUE(e);
  auto pid = e->connect(ByteView(peer_->metadata));
  ASSERT_TRUE(pid.ok());
  LocalBuffer mine(*e, kSize);
  const uint64_t seed2 = RandomSeed();
  FillPattern(seed2, 0, mine.data(), kSize);
  std::vector<TransferId> ids;
  std::vector<LocalIov> ls(64);
  std::vector<RemoteIov> rs(64);
  for (int i = 0; i < 64; ++i) {
    ls[i] = {mine.data() + i * (kSize / 64), kSize / 64};
    rs[i] = {&peer_->rw, i * (kSize / 64), kSize / 64};
    auto id = e->write_async(*pid, {&ls[i], 1}, {&rs[i], 1});
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  for (TransferId id : ids) ASSERT_TRUE(e->wait(id, 60s).ok());
  ASSERT_EQ(peer_->Checksum(0, kSize), PatternHash(seed2, 0, kSize));
  std::memset(mine.data(), 0, kSize);
  ids.clear();
  for (int i = 0; i < 64; ++i) {
    auto id = e->read_async(*pid, {&ls[i], 1}, {&rs[i], 1});
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  for (TransferId id : ids) ASSERT_TRUE(e->wait(id, 60s).ok());
  EXPECT_TRUE(MatchesPattern(seed2, 0, mine.data(), kSize));
}

// Small one-segment operations posted while others to the same peer are in
// flight wait and go out combined, several to one provider operation
// (fabric.combine_after; tcp;ofi_rxm takes 4 remote iovs per operation).
// 3,000 writes of 1 byte ... 16 KiB at random places, through three
// descriptors that share the read-write key (rw, sub, wo), then reads back
// through keys that differ (rw, ro): every range is checked on the target,
// every byte read back, and no byte between ranges changes.
TEST_F(FabricTest, SmallOperationsCombinedLandEveryByte) {
  SKIP_WITHOUT_FABRIC();
  constexpr uint64_t kSize = 48 << 20;
  constexpr size_t kOps = 3000;
  peer_ = StartPeer({.size = kSize, .seed = 77, .engine_options = kPeerFabric});
  ASSERT_TRUE(peer_);
  for (const char* after : {"1", "2"}) {
    SCOPED_TRACE(std::string("fabric.combine_after=") + after);
    auto e = MakeEngine({{"engine.transports", "fabric,tcp"}, {"fabric.combine_after", after}});
    ASSERT_TRUE(e);
    bool combining = false;
    for (const auto& t : e->transports()) {
      if (t.name == "fabric") combining = t.detail.find("small ops combined") != std::string::npos;
    }
    ASSERT_TRUE(combining) << "the provider takes one remote iov per operation: nothing to test";
    auto pid = e->connect(ByteView(peer_->metadata));
    ASSERT_TRUE(pid.ok()) << pid.status().to_string();
    LocalBuffer mine(*e, kSize);
    std::mt19937_64 rng(RandomSeed());
    const uint64_t seed = rng();
    FillPattern(seed, 0, mine.data(), kSize);
    // The target's memory starts as the pattern of seed 77; ranges are
    // disjoint, each within a slot of kSize / kOps (16 KiB).
    const uint64_t slot = kSize / kOps;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (size_t i = 0; i < kOps; ++i) {
      const uint64_t len = i % 3 == 0 ? 1 + rng() % 64 : 1 + rng() % slot;
      ranges.emplace_back(i * slot + rng() % (slot - len + 1), len);
    }
    std::shuffle(ranges.begin(), ranges.end(), rng);
    ASSERT_EQ(peer_->Command("fill 77 0 " + std::to_string(kSize)), "OK");
    const uint64_t quarter = kSize / 4;  // sub is [size/4, size/2)
    std::vector<LocalIov> ls(kOps);
    std::vector<RemoteIov> rs(kOps);
    std::vector<TransferId> ids;
    for (size_t i = 0; i < kOps; ++i) {
      const auto [off, len] = ranges[i];
      ls[i] = {mine.data() + off, len};
      if (off >= quarter && off + len <= 2 * quarter && i % 2 == 0) {
        rs[i] = {&peer_->sub, off - quarter, len};
      } else {
        rs[i] = {i % 5 == 1 ? &peer_->wo : &peer_->rw, off, len};
      }
      auto id = e->write_async(*pid, {&ls[i], 1}, {&rs[i], 1});
      ASSERT_TRUE(id.ok()) << id.status().to_string();
      ids.push_back(*id);
    }
    ASSERT_NO_FATAL_FAILURE(WaitAllOk(*e, ids));
    auto sums = peer_->Checksums(ranges);
    ASSERT_TRUE(sums);
    for (size_t i = 0; i < kOps; ++i) {
      ASSERT_EQ((*sums)[i], PatternHash(seed, ranges[i].first, ranges[i].second))
          << "write " << i << ": " << ranges[i].second << " bytes at " << ranges[i].first;
    }
    // Nothing landed outside the ranges: the target's whole buffer is the
    // ranges' bytes on its own pattern.
    std::vector<uint8_t> expect(kSize);
    FillPattern(77, 0, expect.data(), kSize);
    for (const auto& [off, len] : ranges) std::memcpy(expect.data() + off, mine.data() + off, len);
    ASSERT_EQ(peer_->Checksum(0, kSize), HashBytes(expect.data(), kSize));
    // Read every range back, alternating keys (rw, ro), into memory holding
    // the same pattern as the target's outside the ranges.
    std::memcpy(mine.data(), expect.data(), kSize);
    for (const auto& [off, len] : ranges) std::memset(mine.data() + off, 0, len);
    ids.clear();
    for (size_t i = 0; i < kOps; ++i) {
      const auto [off, len] = ranges[i];
      rs[i] = {i % 2 ? &peer_->ro : &peer_->rw, off, len};
      auto id = e->read_async(*pid, {&ls[i], 1}, {&rs[i], 1});
      ASSERT_TRUE(id.ok()) << id.status().to_string();
      ids.push_back(*id);
    }
    ASSERT_NO_FATAL_FAILURE(WaitAllOk(*e, ids));
    ASSERT_EQ(HashBytes(mine.data(), kSize), HashBytes(expect.data(), kSize));
    // The calls did go out combined, writes and reads alike.
    const uint64_t ops = FabricCounter(*e, "rma_ops");
    const uint64_t combined = FabricCounter(*e, "combined_calls");
    std::printf(
        "combine_after=%s: %zu calls in %llu provider operations, %llu of them carried "
        "by %llu combined operations, %llu waited for company\n",
        after, 2 * kOps, static_cast<unsigned long long>(ops),
        static_cast<unsigned long long>(combined),
        static_cast<unsigned long long>(FabricCounter(*e, "combined_ops")),
        static_cast<unsigned long long>(FabricCounter(*e, "held_calls")));
    EXPECT_GT(combined, kOps / 2);
    EXPECT_LT(ops, 2 * kOps);
    for (size_t i = 0; i < kOps; i += 97) {
      size_t bad = 0;
      ASSERT_TRUE(MatchesPattern(seed, ranges[i].first, mine.data() + ranges[i].first,
                                 ranges[i].second, &bad))
          << "read " << i << " differs at byte " << bad;
    }
  }
}

// Small writes waiting for company behind a large write when the peer dies:
// every one ends (PeerDisconnected, or done before the kill) within 2 s; a
// cancelled one ends Cancelled (or done) and the rest are unaffected.
TEST_F(FabricTest, HeldSmallOperationsEndWhenCancelledOrThePeerDies) {
  SKIP_WITHOUT_FABRIC();
  constexpr uint64_t kSize = 64 << 20;
  ASSERT_NO_FATAL_FAILURE(Start(kSize, {{"fabric.combine_after", "1"}}));
  Engine* e = engine_.get();
  const PeerId* pid = &pid_;
  LocalBuffer& mine = *local_;
  const uint64_t seed = RandomSeed();
  FillPattern(seed, 0, mine.data(), kSize);
  constexpr uint64_t kBig = kSize / 2;
  LocalIov bl{mine.data(), kBig};
  RemoteIov br{&peer_->rw, 0, kBig};
  // Round 1: cancel a held write; the others land. Full groups of 4 go out
  // at once, so the last of 201 is the one left waiting (unless everything
  // before it completed already).
  auto big = e->write_async(*pid, {&bl, 1}, {&br, 1});
  ASSERT_TRUE(big.ok());
  constexpr size_t kSmall = 201;
  constexpr size_t kCancelled = kSmall - 1;
  std::vector<LocalIov> ls(kSmall);
  std::vector<RemoteIov> rs(kSmall);
  std::vector<TransferId> ids;
  for (size_t i = 0; i < kSmall; ++i) {
    const uint64_t off = kBig + i * 8192;
    ls[i] = {mine.data() + off, 4096};
    rs[i] = {&peer_->rw, off, 4096};
    auto id = e->write_async(*pid, {&ls[i], 1}, {&rs[i], 1});
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  ASSERT_TRUE(e->cancel(ids[kCancelled]).ok());
  Status c = e->wait(ids[kCancelled], 10s);
  EXPECT_TRUE(c.ok() || c.code() == StatusCode::kCancelled) << c.to_string();
  std::printf("the last small write: %s\n", c.ok() ? "done before the cancel" : "cancelled");
  EXPECT_GT(FabricCounter(*e, "held_calls"), 0u);
  ASSERT_TRUE(e->wait(*big, 60s).ok());
  for (size_t i = 0; i < kSmall; ++i) {
    if (i == kCancelled) continue;
    Status s = e->wait(ids[i], 60s);
    ASSERT_TRUE(s.ok()) << i << ": " << s.to_string();
    ASSERT_EQ(peer_->Checksum(kBig + i * 8192, 4096), PatternHash(seed, kBig + i * 8192, 4096));
  }
  // Round 2: the peer is killed with small writes held behind large ones. It
  // is stopped first, so that none of them can complete before the kill (on a
  // slow build they all had, and the round tested nothing).
  peer_->process().Kill(SIGSTOP);
  ASSERT_TRUE(WaitAllThreadsStopped(peer_->process().pid(), 10s));
  ids.clear();
  for (int k = 0; k < 3; ++k) {
    auto id = e->write_async(*pid, {&bl, 1}, {&br, 1});
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  for (size_t i = 0; i < kSmall; ++i) {
    auto id = e->write_async(*pid, {&ls[i], 1}, {&rs[i], 1});
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  peer_->process().Kill(SIGKILL);
  const auto killed = Clock::now();
  size_t failed = 0;
  for (TransferId id : ids) {
    Status s = e->wait(id, 10s);
    if (s.ok()) continue;
    ++failed;
    EXPECT_EQ(s.code(), StatusCode::kPeerDisconnected) << s.to_string();
  }
  const double s_taken = std::chrono::duration<double>(Clock::now() - killed).count();
  std::printf("%zu of %zu transfers failed, all done %.2f s after the kill\n", failed, ids.size(),
              s_taken);
  EXPECT_GT(failed, 0u);
  EXPECT_LT(s_taken, 2.0);
}

// A held call waits for one completion on its peer at most: a stream of
// calls through another key, which keeps the peer busy and forms full
// groups of its own, does not keep it waiting until the stream ends.
TEST_F(FabricTest, HeldCallIsNotStarvedByAStreamThroughAnotherKey) {
  SKIP_WITHOUT_FABRIC();
  constexpr uint64_t kSize = 32 << 20;
  constexpr size_t kStream = 4000;
  ASSERT_NO_FATAL_FAILURE(Start(kSize, {{"fabric.combine_after", "1"}}));
  Engine* e = engine_.get();
  const PeerId* pid = &pid_;
  LocalBuffer& mine = *local_;
  // Reads through rw (one key) and one through ro (the read-only key).
  std::vector<LocalIov> ls(kStream);
  std::vector<RemoteIov> rs(kStream);
  std::vector<TransferId> ids;
  TransferId lone = 0;
  LocalIov ll{mine.data() + kSize - 4096, 4096};
  RemoteIov lr{&peer_->ro, kSize - 4096, 4096};
  // The lone call is watched while the stream is still being posted: where
  // posting is slow (sanitizers), the peer may serve the whole stream before
  // the last call is posted, and only the order of the two completions says
  // whether the lone call waited for the stream.
  bool lone_done = false;
  for (size_t i = 0; i < kStream; ++i) {
    ls[i] = {mine.data() + i * 4096, 4096};
    rs[i] = {&peer_->rw, i * 4096, 4096};
    auto id = e->read_async(*pid, {&ls[i], 1}, {&rs[i], 1});
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
    if (i == 100) {
      auto l = e->read_async(*pid, {&ll, 1}, {&lr, 1});
      ASSERT_TRUE(l.ok()) << l.status().to_string();
      lone = *l;
    } else if (i > 100 && !lone_done) {
      const Status s = e->test(lone);  // done before the stream's last call was even posted
      lone_done = s.code() != StatusCode::kInProgress;
      ASSERT_TRUE(!lone_done || s.ok()) << s.to_string();
    }
  }
  Status last = Status::Ok();
  if (!lone_done) {
    ASSERT_TRUE(e->wait(lone, 60s).ok());
    last = e->test(ids.back());
    EXPECT_EQ(last.code(), StatusCode::kInProgress)
        << "the lone call waited for the whole stream of " << kStream << " calls";
  }
  for (TransferId id : ids) {
    if (id == ids.back() && !lone_done && last.code() != StatusCode::kInProgress) continue;
    ASSERT_TRUE(e->wait(id, 60s).ok());
  }
  EXPECT_TRUE(MatchesPattern(77, 0, mine.data(), kStream * 4096));
  EXPECT_TRUE(MatchesPattern(77, kSize - 4096, mine.data() + kSize - 4096, 4096));
  EXPECT_GT(FabricCounter(*e, "combined_calls"), kStream / 2);
}

TEST_F(FabricTest, NotificationArrivesAfterAllData) {
  constexpr uint64_t kSize = 16 << 20;
  Start(kSize);
  constexpr int kCount = 12;
  ASSERT_EQ(peer_->Command("watch " + std::to_string(kCount) + " 60000", 5s), "WATCHING");
  std::mt19937_64 rng(RandomSeed());
  uint64_t at = 0;  // disjoint ranges: the peer checks each one when its note arrives
  for (int i = 0; i < kCount; ++i, at += std::min<uint64_t>(kSize, uint64_t{1} << (i * 2))) {
    // Sizes from 1 byte to 16 MiB, many iovs for some.
    const uint64_t len = i == 0 ? 1 : std::min<uint64_t>(kSize, uint64_t{1} << (i * 2));
    const uint64_t seed = rng();
    ASSERT_LE(at + len, kSize);
    FillPattern(seed, 0, local_->data(), len);
    std::vector<LocalIov> l;
    std::vector<RemoteIov> r;
    const uint64_t piece = std::max<uint64_t>(1, len / 64);
    for (uint64_t off = 0; off < len; off += piece) {
      const uint64_t n = std::min(piece, len - off);
      l.push_back({local_->data() + off, n});
      r.push_back({&peer_->rw, at + off, n});
    }
    const std::string note =
        std::to_string(at) + " " + std::to_string(len) + " " + Hex64(PatternHash(seed, 0, len));
    auto id = engine_->write_async(
        pid_, l, r, ByteView(reinterpret_cast<const uint8_t*>(note.data()), note.size()));
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ASSERT_TRUE(engine_->wait(*id, 60s).ok());
  }
  const std::string done = peer_->process().ReadLine(60s).value_or("");
  EXPECT_EQ(done,
            "OK received=" + std::to_string(kCount) + " good=" + std::to_string(kCount) + " bad=0");
  // A standalone notification.
  const char text[] = "standalone";
  ASSERT_TRUE(engine_->notify(pid_, ByteView(reinterpret_cast<const uint8_t*>(text), 10)).ok());
  EXPECT_NE(peer_->Command("notifications 1 5000")
                .find(ToHex(reinterpret_cast<const uint8_t*>(text), 10)),
            std::string::npos);
}

TEST_F(FabricTest, RefusalsNameTheRegion) {
  constexpr uint64_t kSize = 1 << 20;
  Start(kSize);
  const uint64_t original = PatternHash(77, 0, kSize);
  auto write = [&](const RemoteDescriptor& d, uint64_t off, uint64_t len) {
    LocalIov l{local_->data(), len};
    RemoteIov r{&d, off, len};
    return engine_->write(pid_, {&l, 1}, {&r, 1}, std::nullopt, 30s);
  };
  auto read = [&](const RemoteDescriptor& d, uint64_t off, uint64_t len) {
    LocalIov l{local_->data(), len};
    RemoteIov r{&d, off, len};
    return engine_->read(pid_, {&l, 1}, {&r, 1}, 30s);
  };
  FillPattern(5, 0, local_->data(), kSize);
  RemoteDescriptor bad = peer_->rw;
  bad.key ^= 1;
  Status s = write(bad, 0, 4096);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  EXPECT_TRUE(NamesRegion(s, peer_->region)) << s.to_string();
  s = read(bad, 0, 4096);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  RemoteDescriptor wider = peer_->sub;
  wider.length += 4096;
  s = write(wider, 0, 16);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  s = write(peer_->ro, 0, 4096);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  s = write(peer_->rw, kSize - 10, 20);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s.to_string();
  EXPECT_EQ(peer_->Checksum(0, kSize), original) << "refused operations changed the target";
  // A read-only grant works for reads.
  ASSERT_TRUE(read(peer_->ro, 0, 4096).ok());
  EXPECT_TRUE(MatchesPattern(77, 0, local_->data(), 4096));
  // Used once (key cached here), then deregistered: refused, naming it.
  ASSERT_TRUE(write(peer_->rw, 0, 4096).ok());
  ASSERT_EQ(peer_->Command("dereg"), "OK");
  const uint64_t after = *peer_->Checksum(0, kSize);
  s = write(peer_->rw, 0, 4096);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
  EXPECT_TRUE(NamesRegion(s, peer_->region)) << s.to_string();
  s = read(peer_->ro, 0, 4096);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
  EXPECT_EQ(peer_->Checksum(0, kSize), after) << "a write after deregistration landed";
}

TEST_F(FabricTest, PeerKilledMidTransferFailsWithin2s) {
  constexpr uint64_t kSize = 64 << 20;
  Start(kSize);
  auto bystander = StartPeer({.size = 1 << 20, .seed = 3, .engine_options = kPeerFabric});
  ASSERT_TRUE(bystander);
  auto bid = engine_->connect(ByteView(bystander->metadata));
  ASSERT_TRUE(bid.ok());
  LocalIov l{local_->data(), kSize};
  RemoteIov r{&peer_->rw, 0, kSize};
  std::vector<TransferId> ids;
  for (int i = 0; i < 24; ++i) {
    auto id = i % 4 == 3 ? engine_->read_async(pid_, {&l, 1}, {&r, 1})
                         : engine_->write_async(pid_, {&l, 1}, {&r, 1});
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  ASSERT_TRUE(engine_->wait(ids[0], 60s).ok());
  ASSERT_EQ(engine_->test(ids.back()).code(), StatusCode::kInProgress);
  peer_->process().Kill(SIGKILL);
  const auto killed = Clock::now();
  for (size_t i = 1; i < ids.size(); ++i) {
    Status s = engine_->wait(ids[i], 10s);
    if (s.ok()) continue;  // finished before the kill
    EXPECT_EQ(s.code(), StatusCode::kPeerDisconnected) << s.to_string();
  }
  const double s_taken = std::chrono::duration<double>(Clock::now() - killed).count();
  std::printf("all transfers done %.2f s after the kill\n", s_taken);
  EXPECT_LT(s_taken, 2.0);
  // Other peers are still served.
  LocalBuffer small(*engine_, 1 << 20);
  FillPattern(9, 0, small.data(), 1 << 20);
  LocalIov sl{small.data(), 1 << 20};
  RemoteIov sr{&bystander->rw, 0, 1 << 20};
  Status s = engine_->write(*bid, {&sl, 1}, {&sr, 1}, std::nullopt, 30s);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(bystander->Checksum(0, 1 << 20), PatternHash(9, 0, 1 << 20));
}

TEST(FabricUnavailable, MissingLibraryLeavesTcpWorking) {
  auto e = MakeEngine(
      {{"fabric.library", "/nonexistent/libfabric.so.1"}, {"engine.transports", "auto"}});
  ASSERT_TRUE(e);
  bool reported = false;
  for (const auto& t : e->transports()) {
    if (t.name == "fabric") {
      EXPECT_FALSE(t.running);
      reported = t.detail.find("/nonexistent/libfabric.so.1") != std::string::npos;
      std::printf("fabric: %s\n", t.detail.c_str());
    }
  }
  EXPECT_TRUE(reported);
  // Named explicitly, it is an error at create, with the reason.
  EngineConfig c;
  c.listen = "127.0.0.1:0";
  c.options = {{"fabric.library", "/nonexistent/libfabric.so.1"},
               {"engine.transports", "fabric,tcp"}};
  auto named = Engine::create(c);
  ASSERT_FALSE(named.ok());
  EXPECT_NE(named.status().message().find("/nonexistent/libfabric.so.1"), std::string::npos);
  // tcp carries the data.
  auto peer = StartPeer({.size = 1 << 20, .seed = 4, .engine_options = kPeerFabric});
  ASSERT_TRUE(peer);
  auto pid = e->connect(ByteView(peer->metadata));
  ASSERT_TRUE(pid.ok()) << pid.status().to_string();
  LocalBuffer buf(*e, 1 << 20);
  FillPattern(8, 0, buf.data(), 1 << 20);
  LocalIov l{buf.data(), 1 << 20};
  RemoteIov r{&peer->rw, 0, 1 << 20};
  ASSERT_TRUE(e->write(*pid, {&l, 1}, {&r, 1}, std::nullopt, 30s).ok());
  EXPECT_EQ(peer->Checksum(0, 1 << 20), PatternHash(8, 0, 1 << 20));
}

// Without fabric.provider, libfabric's same-host providers are passed over
// (the engine's shm and cuda_ipc transports serve this host; Ubuntu's
// libfabric lists shm first, and two engines on one host collided on its
// endpoint names). FI_PROVIDER=shm leaves libfabric nothing else to offer:
// the transport then says what it passed over and why; named, shm runs.
// libfabric reads FI_PROVIDER once per process, so this holds only in a
// process where it was not initialised before (ctest runs each test alone).
TEST(FabricUnavailable, SameHostProviderIsPassedOverUnlessNamed) {
  setenv("FI_PROVIDER", "shm", 1);
  auto fabric_detail = [](std::map<std::string, std::string> options, bool* running) {
    options["engine.transports"] = "auto";
    auto e = MakeEngine(std::move(options));
    std::string detail;
    for (const auto& t : e ? e->transports() : std::vector<TransportInfo>{}) {
      if (t.name == "fabric") {
        detail = t.detail;
        *running = t.running;
      }
    }
    return detail;
  };
  bool running = false;
  const std::string unnamed = fabric_detail({}, &running);
  unsetenv("FI_PROVIDER");
  if (unnamed.find("shm") == std::string::npos) {
    GTEST_SKIP() << "libfabric here offers no shm provider, or read FI_PROVIDER before this test: "
                 << unnamed;
  }
  EXPECT_FALSE(running) << unnamed;
  EXPECT_NE(unnamed.find("passed over: shm (same host only"), std::string::npos) << unnamed;
  setenv("FI_PROVIDER", "shm", 1);
  const std::string named = fabric_detail({{"fabric.provider", "shm"}}, &running);
  unsetenv("FI_PROVIDER");
  EXPECT_TRUE(running) << named;
  EXPECT_EQ(named.rfind("shm", 0), 0u) << named;
}

TEST(FabricWire, MalformedMessagesAreProtocolErrors) {
  using namespace ferry::fabric;
  Bytes ok = encode(MsgType::kPing, 7, 1, {});
  EXPECT_TRUE(decode_header(ok.data(), ok.size()).ok());
  EXPECT_EQ(decode_header(ok.data(), 10).status().code(), StatusCode::kProtocolError);
  Bytes bad = ok;
  bad[0] ^= 1;
  EXPECT_EQ(decode_header(bad.data(), bad.size()).status().code(), StatusCode::kProtocolError);
  bad = ok;
  bad[5] = 200;  // type
  EXPECT_EQ(decode_header(bad.data(), bad.size()).status().code(), StatusCode::kProtocolError);
  bad = encode(MsgType::kNotify, 7, 1, Bytes(10));
  bad[24] = 11;  // body length beyond what arrived
  EXPECT_EQ(decode_header(bad.data(), bad.size()).status().code(), StatusCode::kProtocolError);
  Bytes g = encode_grant_req({1, 2, 3, 4, 3});
  EXPECT_TRUE(decode_grant_req(g).ok());
  g.pop_back();
  EXPECT_EQ(decode_grant_req(g).status().code(), StatusCode::kProtocolError);
  g.push_back(3);
  g.push_back(0);
  EXPECT_EQ(decode_grant_req(g).status().code(), StatusCode::kProtocolError);
  Bytes h = encode_hello({1, 0, "tcp;ofi_rxm", Bytes(16, 1), kHelloHmem});
  ASSERT_TRUE(decode_hello(h).ok());
  EXPECT_EQ(decode_hello(h)->flags, kHelloHmem);
  // An older sender's HELLO ends with the address: no flags, still read.
  Bytes old_hello(h.begin(), h.end() - 2);
  ASSERT_TRUE(decode_hello(old_hello).ok());
  EXPECT_EQ(decode_hello(old_hello)->flags, 0);
  h.push_back(0);  // a byte past the flags
  EXPECT_EQ(decode_hello(h).status().code(), StatusCode::kProtocolError);
  h.pop_back();
  h[h.size() - 2 - 17] = 0xff;  // address length (before 16 address bytes and the flags)
  EXPECT_EQ(decode_hello(h).status().code(), StatusCode::kProtocolError);
  Bytes gr = encode_grant({err::NotFound("region 5"), 1, 2});
  auto back = decode_grant(gr);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->status.code(), StatusCode::kNotFound);
  gr[0] = 250;
  EXPECT_EQ(decode_grant(gr).status().code(), StatusCode::kProtocolError);
}

}  // namespace
}  // namespace ferry::itest
