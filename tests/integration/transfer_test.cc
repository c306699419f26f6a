// Two processes over loopback: one-sided WRITE and READ, verified byte for
// byte against the target's real memory (through ferry_test_peer's checksum
// command, never through Ferry itself) and against the known pattern.
#include <sys/sysinfo.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <csignal>
#include <cstdio>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include "fixture.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kGapRemote = 13;  // untouched bytes between remote slots
constexpr uint64_t kGapLocal = 5;    // and between local iovs
constexpr uint64_t kMaxCaseBytes = 1100ull << 20;

uint64_t PhysicalMemory() {
  struct sysinfo si {};
  sysinfo(&si);
  return static_cast<uint64_t>(si.totalram) * si.mem_unit;
}

// Where iov i of a batch lives: remote slots in a shuffled order (so a
// transport that mixes up iov order is caught), local iovs in order.
struct Layout {
  uint64_t size = 0;
  size_t batch = 0;
  std::vector<uint64_t> remote, local;
  uint64_t remote_bytes = 0, local_bytes = 0;

  Layout(uint64_t s, size_t b, uint64_t seed) : size(s), batch(b), remote(b), local(b) {
    std::vector<size_t> perm(b);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(seed));
    for (size_t i = 0; i < b; ++i) {
      remote[i] = kGapRemote + perm[i] * (s + kGapRemote);
      local[i] = kGapLocal + i * (s + kGapLocal);
    }
    remote_bytes = kGapRemote + b * (s + kGapRemote);
    local_bytes = kGapLocal + b * (s + kGapLocal);
  }
};

void MakeIovs(const Layout& l, uint8_t* base, const RemoteDescriptor* d, std::vector<LocalIov>* li,
              std::vector<RemoteIov>* ri) {
  li->clear();
  ri->clear();
  for (size_t i = 0; i < l.batch; ++i) {
    li->push_back({base + l.local[i], l.size});
    ri->push_back({d, l.remote[i], l.size});
  }
}

// Every byte of the target's [0, remote_bytes): data slots must hash like the
// local iov that was written there, gaps like the target's original pattern.
void ExpectTargetHolds(TestPeer& peer, const Layout& l, const uint8_t* local, uint64_t target_seed,
                       const std::string& what) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::vector<uint64_t> expect;
  std::vector<std::string> names;
  std::vector<size_t> order(l.batch);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return l.remote[a] < l.remote[b]; });
  uint64_t pos = 0;
  for (size_t i : order) {
    if (l.remote[i] > pos) {
      ranges.push_back({pos, l.remote[i] - pos});
      expect.push_back(PatternHash(target_seed, pos, l.remote[i] - pos));
      names.push_back("gap before iov " + std::to_string(i));
    }
    ranges.push_back({l.remote[i], l.size});
    expect.push_back(HashBytes(local + l.local[i], l.size));
    names.push_back("iov " + std::to_string(i));
    pos = l.remote[i] + l.size;
  }
  ranges.push_back({pos, l.remote_bytes - pos});
  expect.push_back(PatternHash(target_seed, pos, l.remote_bytes - pos));
  names.push_back("tail");
  auto got = peer.Checksums(ranges);
  ASSERT_TRUE(got.has_value()) << "target did not answer checksums";
  int reported = 0;
  for (size_t k = 0; k < ranges.size(); ++k) {
    if ((*got)[k] != expect[k] && reported++ < 5) {
      ADD_FAILURE() << what << ": target memory differs in " << names[k] << " at ["
                    << ranges[k].first << ", +" << ranges[k].second << ")";
    }
  }
  EXPECT_EQ(reported, 0) << what << ": " << reported << " ranges differ";
}

// Local iovs must hold what the target had at the matching remote slots
// (pattern `seed` at the remote positions), local gaps must be untouched.
void ExpectLocalHolds(const Layout& l, const uint8_t* local, uint64_t seed, bool remote_positions,
                      uint8_t poison, const std::string& what) {
  int reported = 0;
  for (size_t i = 0; i < l.batch && reported < 5; ++i) {
    size_t bad = 0;
    const uint64_t pos = remote_positions ? l.remote[i] : l.local[i];
    if (!MatchesPattern(seed, pos, local + l.local[i], l.size, &bad)) {
      ADD_FAILURE() << what << ": iov " << i << " (remote offset " << l.remote[i]
                    << ") differs at byte " << bad;
      ++reported;
    }
  }
  for (size_t i = 0; i <= l.batch && reported < 5; ++i) {
    const uint64_t start = i == 0 ? 0 : l.local[i - 1] + l.size;
    for (uint64_t k = start; k < start + kGapLocal; ++k) {
      if (local[k] != poison) {
        ADD_FAILURE() << what << ": byte " << k << " between local iovs was written";
        ++reported;
        break;
      }
    }
  }
}

// ---------------------------------------------------------------------------

struct MatrixCase {
  uint64_t size;
  size_t batch;
};

std::string CaseName(const ::testing::TestParamInfo<MatrixCase>& info) {
  std::string s;
  switch (info.param.size) {
    case 1:
      s = "1B";
      break;
    case 4096:
      s = "4KiB";
      break;
    case (1 << 20) + 3:
      s = "1MiBPlus3";
      break;
    case 64 << 20:
      s = "64MiB";
      break;
    default:
      s = std::to_string(info.param.size);
  }
  return s + "_Batch" + std::to_string(info.param.batch);
}

class WriteReadMatrix : public ::testing::TestWithParam<MatrixCase> {};

TEST_P(WriteReadMatrix, SyncAndAsyncVerifiedByteForByte) {
  const auto [size, batch] = GetParam();
  const Layout l(size, batch, size * 31 + batch);
  if (l.remote_bytes > kMaxCaseBytes) {
    GTEST_SKIP() << size << " B x " << batch << " = " << (size * batch >> 20)
                 << " MiB per call needs that much memory on each side and ~"
                 << (size * batch >> 30) << " s per pass on 2 cores; cases above "
                 << (kMaxCaseBytes >> 20) << " MiB are skipped (64 MiB x 1024 = 64 GiB)";
  }
  if (PhysicalMemory() < 4 * (l.remote_bytes + l.local_bytes)) {
    GTEST_SKIP() << "not enough memory for " << (l.remote_bytes >> 20) << " MiB per side";
  }
  const uint64_t target_seed = 1000 + batch;
  auto peer = StartPeer({.size = l.remote_bytes, .seed = target_seed});
  ASSERT_TRUE(peer);
  auto engine = MakeEngine();
  ASSERT_TRUE(engine);
  auto pid = engine->connect(ByteView(peer->metadata));
  ASSERT_TRUE(pid.ok()) << pid.status().to_string();
  ASSERT_EQ(*pid, peer->engine_id);
  LocalBuffer local(*engine, l.local_bytes);
  std::vector<LocalIov> li;
  std::vector<RemoteIov> ri;
  MakeIovs(l, local.data(), &peer->rw, &li, &ri);

  // A. blocking read of the untouched target.
  std::memset(local.data(), 0xEE, l.local_bytes);
  Status s = engine->read(*pid, li, ri, 120s);
  ASSERT_TRUE(s.ok()) << "read: " << s.to_string();
  ExpectLocalHolds(l, local.data(), target_seed, true, 0xEE, "blocking read");

  // B. blocking write of random data.
  FillPattern(7001, 0, local.data(), l.local_bytes);
  s = engine->write(*pid, li, ri, std::nullopt, 120s);
  ASSERT_TRUE(s.ok()) << "write: " << s.to_string();
  ExpectTargetHolds(*peer, l, local.data(), target_seed, "blocking write");

  // C. async read of what B wrote, completed by polling test().
  std::memset(local.data(), 0xDD, l.local_bytes);
  auto rid = engine->read_async(*pid, li, ri);
  ASSERT_TRUE(rid.ok()) << rid.status().to_string();
  ASSERT_NE(*rid, 0u);
  s = PollUntilDone(*engine, *rid, 120s);
  ASSERT_TRUE(s.ok()) << "async read: " << s.to_string();
  ExpectLocalHolds(l, local.data(), 7001, false, 0xDD, "async read");

  // D. async write of new data, completed by wait().
  FillPattern(7002, 0, local.data(), l.local_bytes);
  auto wid = engine->write_async(*pid, li, ri);
  ASSERT_TRUE(wid.ok()) << wid.status().to_string();
  s = engine->wait(*wid, 120s);
  ASSERT_TRUE(s.ok()) << "async write: " << s.to_string();
  ExpectTargetHolds(*peer, l, local.data(), target_seed, "async write");

  // The ids are released once their final status was reported.
  EXPECT_EQ(engine->test(*rid).code(), StatusCode::kNotFound);
  EXPECT_EQ(engine->wait(*wid, 1ms).code(), StatusCode::kNotFound);
  EXPECT_NE(*rid, *wid);
}

INSTANTIATE_TEST_SUITE_P(Loopback, WriteReadMatrix,
                         ::testing::Values(MatrixCase{1, 1}, MatrixCase{1, 7}, MatrixCase{1, 1024},
                                           MatrixCase{4096, 1}, MatrixCase{4096, 7},
                                           MatrixCase{4096, 1024}, MatrixCase{(1 << 20) + 3, 1},
                                           MatrixCase{(1 << 20) + 3, 7},
                                           MatrixCase{(1 << 20) + 3, 1024}, MatrixCase{64 << 20, 1},
                                           MatrixCase{64 << 20, 7}, MatrixCase{64 << 20, 1024}),
                         CaseName);

// ---------------------------------------------------------------------------

class TransferTest : public ::testing::Test {
 protected:
  void Connect(uint64_t peer_size, std::map<std::string, std::string> options = {},
               std::vector<std::string> peer_options = {}) {
    peer_ =
        StartPeer({.size = peer_size, .seed = kSeed, .engine_options = std::move(peer_options)});
    ASSERT_TRUE(peer_);
    engine_ = MakeEngine(std::move(options));
    ASSERT_TRUE(engine_);
    auto p = engine_->connect(ByteView(peer_->metadata));
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    pid_ = *p;
  }
  // A small write + read round trip that must work (the engine is healthy).
  void ExpectHealthy(LocalBuffer& buf, uint64_t seed) {
    FillPattern(seed, 0, buf.data(), 4096);
    LocalIov l{buf.data(), 4096};
    RemoteIov r{&peer_->rw, 0, 4096};
    Status s = engine_->write(pid_, {&l, 1}, {&r, 1}, std::nullopt, 30s);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(peer_->Checksum(0, 4096), PatternHash(seed, 0, 4096));
    std::memset(buf.data(), 0, 4096);
    s = engine_->read(pid_, {&l, 1}, {&r, 1}, 30s);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_TRUE(MatchesPattern(seed, 0, buf.data(), 4096));
  }
  static constexpr uint64_t kSeed = 42;
  std::unique_ptr<TestPeer> peer_;
  std::unique_ptr<Engine> engine_;
  PeerId pid_ = 0;
};

// engine.merge_iovs: iovs that continue each other on both sides reach the
// transport as one segment, but only within one local region and one
// descriptor. The batch below has runs that cross a boundary between two
// local regions laid back to back, switch between two descriptors of the
// same remote bytes, and continue locally but not remotely; every byte is
// checked on the target after the write and locally after the read, with
// merging on and off.
TEST_F(TransferTest, AdjacentIovsMergeOnlyWithinOneRegionAndDescriptor) {
  constexpr size_t kIov = 4096, kIovs = 64, kHalf = kIov * kIovs / 2;
  for (const char* merge : {"true", "false"}) {
    SCOPED_TRACE(std::string("engine.merge_iovs=") + merge);
    Connect(1 << 20, {{"engine.merge_iovs", merge}});
    // One buffer, registered as two regions that touch.
    Buffer buf(2 * kHalf);
    auto first = engine_->register_memory(buf.data(), kHalf);
    auto second = engine_->register_memory(buf.data() + kHalf, kHalf);
    ASSERT_TRUE(first.ok() && second.ok());
    const RemoteDescriptor other = peer_->rw;  // same bytes, another descriptor object
    std::vector<LocalIov> l(kIovs);
    std::vector<RemoteIov> r(kIovs);
    std::vector<uint64_t> remote_at(kIovs);
    for (size_t i = 0; i < kIovs; ++i) {
      // Iovs 40..47 are swapped in pairs remotely: adjacent locally only.
      size_t slot = i;
      if (i >= 40 && i < 48) slot = i ^ 1;
      remote_at[i] = 8192 + slot * kIov;
      l[i] = {buf.data() + i * kIov, kIov};
      // From iov 48 on, every other iov names the second descriptor.
      const RemoteDescriptor* d = (i >= 48 && i % 2 == 1) ? &other : &peer_->rw;
      r[i] = {d, remote_at[i], kIov};
    }
    FillPattern(9100, 0, buf.data(), 2 * kHalf);
    Status s = engine_->write(pid_, l, r, std::nullopt, 30s);
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (size_t i = 0; i < kIovs; ++i) {
      EXPECT_EQ(peer_->Checksum(remote_at[i], kIov), HashBytes(buf.data() + i * kIov, kIov))
          << "iov " << i;
    }
    // The bytes around the written range are untouched.
    EXPECT_EQ(peer_->Checksum(0, 8192), PatternHash(kSeed, 0, 8192));
    EXPECT_EQ(peer_->Checksum(8192 + kIovs * kIov, 4096),
              PatternHash(kSeed, 8192 + kIovs * kIov, 4096));
    std::vector<uint8_t> sent(buf.data(), buf.data() + 2 * kHalf);
    std::memset(buf.data(), 0x5C, 2 * kHalf);
    s = engine_->read(pid_, l, r, 30s);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(0, std::memcmp(buf.data(), sent.data(), sent.size()));
    ASSERT_TRUE(engine_->deregister_memory(first->id).ok());
    ASSERT_TRUE(engine_->deregister_memory(second->id).ok());
    engine_.reset();
    peer_.reset();
  }
}

// engine.test_yield: a caller that polls large transfers with test() in a
// tight loop (as NIXL's check_xfer_state loop does) -- its thread gives the
// CPU up on every poll while the transfer runs -- sees them complete with
// every byte placed, the option on and off, several in flight; a transfer
// whose target is killed under it still ends (with a failure) within the
// deadline; a value that is not a bool is refused with the option's name.
TEST_F(TransferTest, TightTestLoopsOnLargeTransfersCompleteWithYieldOnAndOff) {
  {
    EngineConfig c;
    c.listen = "127.0.0.1:0";
    c.options = {{"engine.test_yield", "sometimes"}};
    auto e = Engine::create(c);
    ASSERT_FALSE(e.ok()) << "engine.test_yield=sometimes was accepted";
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << e.status().to_string();
    EXPECT_NE(e.status().message().find("engine.test_yield"), std::string::npos)
        << e.status().to_string();
  }
  constexpr size_t kCalls = 4;
  constexpr uint64_t kIov = 1179648, kIovs = 8, kCall = kIov * kIovs;  // KV pages
  auto poll = [&](TransferId id) {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    for (;;) {
      Status s = engine_->test(id);
      if (s.code() != StatusCode::kInProgress) return s;
      if (std::chrono::steady_clock::now() > deadline) return s;
    }
  };
  for (const char* yield : {"true", "false"}) {
    SCOPED_TRACE(std::string("engine.test_yield=") + yield);
    ASSERT_NO_FATAL_FAILURE(Connect(kCalls * kCall, {{"engine.test_yield", yield}}));
    auto buf_owner = std::make_unique<LocalBuffer>(*engine_, kCalls * kCall);
    LocalBuffer& buf = *buf_owner;
    std::vector<LocalIov> l(kCalls * kIovs);
    std::vector<RemoteIov> r(kCalls * kIovs);
    for (size_t i = 0; i < l.size(); ++i) {
      l[i] = {buf.data() + i * kIov, kIov};
      r[i] = {&peer_->rw, i * kIov, kIov};
    }
    // kCalls writes (or reads) in flight, then each polled to its end.
    auto post_and_poll = [&](bool write) {
      std::vector<TransferId> ids;
      for (size_t c = 0; c < kCalls; ++c) {
        const auto lc = std::span(l).subspan(c * kIovs, kIovs);
        const auto rc = std::span(r).subspan(c * kIovs, kIovs);
        auto id = write ? engine_->write_async(pid_, lc, rc) : engine_->read_async(pid_, lc, rc);
        ASSERT_TRUE(id.ok()) << id.status().to_string();
        ids.push_back(*id);
      }
      for (size_t c = 0; c < kCalls; ++c) {
        Status s = poll(ids[c]);
        ASSERT_TRUE(s.ok()) << (write ? "write " : "read ") << c << ": " << s.to_string();
      }
    };
    for (int round = 0; round < 2; ++round) {
      const uint64_t seed = 9300 + round + (yield[0] == 't' ? 0 : 10);
      FillPattern(seed, 0, buf.data(), kCalls * kCall);
      ASSERT_NO_FATAL_FAILURE(post_and_poll(true));
      EXPECT_EQ(peer_->Checksum(0, kCalls * kCall), PatternHash(seed, 0, kCalls * kCall));
      std::memset(buf.data(), 0, kCalls * kCall);
      ASSERT_NO_FATAL_FAILURE(post_and_poll(false));
      EXPECT_TRUE(MatchesPattern(seed, 0, buf.data(), kCalls * kCall));
    }
    // The target dies under a large write that the loop polls: the loop ends.
    auto id = engine_->write_async(pid_, l, r);
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    peer_->process().Kill(SIGKILL);
    Status s = poll(*id);
    EXPECT_NE(s.code(), StatusCode::kInProgress) << "still running 60 s after the peer died";
    if (!s.ok()) {
      EXPECT_TRUE(s.code() == StatusCode::kPeerDisconnected || s.code() == StatusCode::kCancelled)
          << s.to_string();
    }
    buf_owner.reset();  // deregistered before the engine goes
    engine_.reset();
    peer_.reset();
  }
}

// tcp.busy_poll_us and tcp.serve_poll_us: I/O threads that poll without
// sleeping for a while after each event, or only after serving a request,
// move the same bytes (writes and reads of several sizes, with gaps longer
// than the polling window between some of them); a value that is neither
// "auto" nor microseconds is refused with the option's name.
TEST_F(TransferTest, TcpBusyPollingMovesEveryByteAndBadValuesAreRefused) {
  for (const char* option : {"tcp.busy_poll_us", "tcp.serve_poll_us"}) {
    for (const char* bad : {"soon", "-5", "12us", "2000000"}) {
      EngineConfig c;
      c.listen = "127.0.0.1:0";
      c.options = {{option, bad}};
      auto e = Engine::create(c);
      ASSERT_FALSE(e.ok()) << option << "=" << bad << " was accepted";
      EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << e.status().to_string();
      EXPECT_NE(e.status().message().find(option), std::string::npos) << e.status().to_string();
    }
  }
  // Both engines: the initiator's I/O threads handle answers, the peer's
  // (the target) requests.
  const std::vector<std::map<std::string, std::string>> settings = {
      {{"tcp.busy_poll_us", "300"}},
      {{"tcp.busy_poll_us", "0"}, {"tcp.serve_poll_us", "300"}},
  };
  uint64_t seed = 500;
  for (const auto& options : settings) {
    std::vector<std::string> peer_options;
    for (const auto& [name, value] : options) peer_options.push_back(name + "=" + value);
    SCOPED_TRACE(peer_options.back());
    ASSERT_NO_FATAL_FAILURE(Connect(8 << 20, options, peer_options));
    LocalBuffer buf(*engine_, 8 << 20);
    for (uint64_t size : {uint64_t{1}, uint64_t{4096}, uint64_t{65536 + 7}, uint64_t{3 << 20}}) {
      for (int round = 0; round < 3; ++round) {
        SCOPED_TRACE(std::to_string(size) + " B, round " + std::to_string(round));
        if (round == 2)
          std::this_thread::sleep_for(std::chrono::milliseconds(2));  // past the window
        FillPattern(++seed, 0, buf.data(), size);
        LocalIov l{buf.data(), size};
        RemoteIov r{&peer_->rw, 4096, size};
        Status s = engine_->write(pid_, {&l, 1}, {&r, 1}, std::nullopt, 30s);
        ASSERT_TRUE(s.ok()) << s.to_string();
        EXPECT_EQ(peer_->Checksum(4096, size), PatternHash(seed, 0, size));
        std::memset(buf.data(), 0, size);
        s = engine_->read(pid_, {&l, 1}, {&r, 1}, 30s);
        ASSERT_TRUE(s.ok()) << s.to_string();
        EXPECT_TRUE(MatchesPattern(seed, 0, buf.data(), size));
      }
    }
  }
}

TEST_F(TransferTest, ConnectCachesPeerAndHostPortWorks) {
  ASSERT_NO_FATAL_FAILURE(Connect(1 << 20));
  auto again = engine_->connect(ByteView(peer_->metadata));
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(*again, pid_);
  auto hp = engine_->connect(std::string_view(peer_->listen));
  ASSERT_TRUE(hp.ok()) << hp.status().to_string();
  EXPECT_EQ(*hp, peer_->engine_id);
  auto peers = engine_->peers();
  EXPECT_NE(std::find(peers.begin(), peers.end(), pid_), peers.end());
  auto address = engine_->peer_address(pid_);
  ASSERT_TRUE(address.ok()) << address.status().to_string();
  EXPECT_EQ(*address, peer_->listen) << "the address connected to";
  LocalBuffer buf(*engine_, 1 << 16);
  ExpectHealthy(buf, 5);
}

TEST_F(TransferTest, ManyAsyncTransfersInFlight) {
  ASSERT_NO_FATAL_FAILURE(Connect(16 << 20));
  constexpr size_t kN = 128;
  constexpr uint64_t kLen = 96 << 10;
  LocalBuffer buf(*engine_, kN * kLen);
  FillPattern(77, 0, buf.data(), kN * kLen);
  std::vector<LocalIov> l(kN);
  std::vector<RemoteIov> r(kN);
  std::vector<TransferId> ids;
  for (size_t i = 0; i < kN; ++i) {
    l[i] = {buf.data() + i * kLen, kLen};
    r[i] = {&peer_->rw, i * kLen, kLen};
    auto id = engine_->write_async(pid_, {&l[i], 1}, {&r[i], 1});
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  std::set<TransferId> unique(ids.begin(), ids.end());
  EXPECT_EQ(unique.size(), ids.size()) << "transfer ids repeat";
  for (size_t i = 0; i < kN; ++i) {
    Status s = i % 2 ? engine_->wait(ids[i], 60s) : PollUntilDone(*engine_, ids[i], 60s);
    EXPECT_TRUE(s.ok()) << "transfer " << i << ": " << s.to_string();
  }
  EXPECT_EQ(peer_->Checksum(0, kN * kLen), HashBytes(buf.data(), kN * kLen));
  // Reads of all of it back, in flight together, into fresh memory.
  std::memset(buf.data(), 0, kN * kLen);
  ids.clear();
  for (size_t i = 0; i < kN; ++i) {
    auto id = engine_->read_async(pid_, {&l[i], 1}, {&r[i], 1});
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  for (auto id : ids) EXPECT_TRUE(engine_->wait(id, 60s).ok());
  EXPECT_TRUE(MatchesPattern(77, 0, buf.data(), kN * kLen));
}

TEST_F(TransferTest, UnknownAndFinishedIdsAreNotFound) {
  ASSERT_NO_FATAL_FAILURE(Connect(1 << 20));
  for (TransferId id : {TransferId{0}, TransferId{999999}, ~TransferId{0}}) {
    Status t = engine_->test(id);
    EXPECT_EQ(t.code(), StatusCode::kNotFound) << t.to_string();
    EXPECT_TRUE(NamesNumber(t, id));
    EXPECT_EQ(engine_->wait(id, 1ms).code(), StatusCode::kNotFound);
    EXPECT_EQ(engine_->cancel(id).code(), StatusCode::kNotFound);
  }
  LocalBuffer buf(*engine_, 4096);
  LocalIov l{buf.data(), 4096};
  RemoteIov r{&peer_->rw, 0, 4096};
  auto id = engine_->write_async(pid_, {&l, 1}, {&r, 1});
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(engine_->wait(*id, 30s).ok());
  Status again = engine_->test(*id);
  EXPECT_EQ(again.code(), StatusCode::kNotFound) << again.to_string();
  EXPECT_TRUE(NamesNumber(again, *id));
}

TEST_F(TransferTest, WaitTimeoutLeavesTheTransferRunning) {
  ASSERT_NO_FATAL_FAILURE(Connect(64 << 20));
  LocalBuffer buf(*engine_, 64 << 20);
  FillPattern(91, 0, buf.data(), 64 << 20);
  std::vector<LocalIov> l(8, LocalIov{buf.data(), 64 << 20});
  std::vector<RemoteIov> r(8, RemoteIov{&peer_->rw, 0, 64 << 20});
  // 512 MiB is not done at once -- unless this thread lost its core between
  // the post and the wait for long enough (a loaded machine): then the write
  // finished, and the wait says Ok. Up to three tries to catch it running.
  Result<TransferId> id = err::Internal("not posted");
  Status early;
  for (int attempt = 0; attempt < 3; ++attempt) {
    id = engine_->write_async(pid_, l, r);
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    early = engine_->wait(*id, 0ms);
    if (!early.ok()) break;
  }
  ASSERT_EQ(early.code(), StatusCode::kTimeout)
      << "512 MiB cannot be done at once; got " << early.to_string();
  EXPECT_EQ(engine_->test(*id).code(), StatusCode::kInProgress);
  Status s = engine_->wait(*id, 120s);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(peer_->Checksum(0, 64 << 20), HashBytes(buf.data(), 64 << 20));
}

TEST_F(TransferTest, CancelLargeWrite) {
  ASSERT_NO_FATAL_FAILURE(Connect(64 << 20));
  LocalBuffer buf(*engine_, 64 << 20);
  FillPattern(92, 0, buf.data(), 64 << 20);
  // 4 GiB: the same 64 MiB written 64 times -- about a second on loopback,
  // so that a test thread descheduled between the post and cancel() on a
  // loaded machine still finds the write running (with 1 GiB, ~0.2 s, a
  // sanitizer run under ctest -j2 once saw it finished).
  std::vector<LocalIov> l(64, LocalIov{buf.data(), 64 << 20});
  std::vector<RemoteIov> r(64, RemoteIov{&peer_->rw, 0, 64 << 20});
  auto id = engine_->write_async(pid_, l, r);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  const Status before = engine_->test(*id);
  Status c = engine_->cancel(*id);
  EXPECT_TRUE(c.ok()) << c.to_string();
  Status s = engine_->wait(*id, 30s);
  EXPECT_EQ(s.code(), StatusCode::kCancelled)
      << s.to_string() << " (status just before cancel(): " << before.to_string() << ")";
  EXPECT_EQ(engine_->test(*id).code(), StatusCode::kNotFound);
  // After cancel() returned the engine no longer reads the source buffer; the
  // application may reuse it at once.
  std::memset(buf.data(), 0x5C, 1 << 20);
  LocalBuffer small(*engine_, 1 << 16);
  ExpectHealthy(small, 93);
}

TEST_F(TransferTest, CancelReturnsAtOnceWhileThePeerIsStalled) {
  // The peer stops reading (SIGSTOP) with a frame of the write half sent:
  // cancel() must not wait for the peer, and the caller's buffer must be free
  // when it returns -- whatever the peer receives later is not read from it.
  constexpr uint64_t kLen = 64 << 20;
  ASSERT_NO_FATAL_FAILURE(Connect(kLen));
  LocalBuffer buf(*engine_, kLen);
  FillPattern(95, 0, buf.data(), kLen);
  std::vector<LocalIov> l(4, LocalIov{buf.data(), kLen});
  std::vector<RemoteIov> r(4, RemoteIov{&peer_->rw, 0, kLen});
  peer_->process().Kill(SIGSTOP);
  auto id = engine_->write_async(pid_, l, r);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  std::this_thread::sleep_for(300ms);  // socket buffers fill; a frame is part sent
  EXPECT_EQ(engine_->test(*id).code(), StatusCode::kInProgress);
  const auto t0 = std::chrono::steady_clock::now();
  Status c = engine_->cancel(*id);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(c.ok()) << c.to_string();
  EXPECT_LT(took, 500ms) << "cancel() waited for the stalled peer";
  std::memset(buf.data(), 0x5C, kLen);  // the buffer is the caller's again
  peer_->process().Kill(SIGCONT);
  EXPECT_EQ(engine_->wait(*id, 30s).code(), StatusCode::kCancelled);
  LocalBuffer small(*engine_, 1 << 16);
  for (int i = 0; i < 4; ++i) ASSERT_NO_FATAL_FAILURE(ExpectHealthy(small, 110 + i));
  // Nothing the peer received came from the buffer after cancel() returned.
  LocalBuffer back(*engine_, kLen);
  LocalIov bl{back.data(), kLen};
  RemoteIov br{&peer_->rw, 0, kLen};
  ASSERT_TRUE(engine_->read(pid_, {&bl, 1}, {&br, 1}, 30s).ok());
  std::vector<uint8_t> poison(4096, 0x5C);
  for (uint64_t at = 0; at + 4096 <= kLen; at += 4096) {
    ASSERT_NE(std::memcmp(back.data() + at, poison.data(), 4096), 0)
        << "the peer holds bytes written to the source after cancel() returned, at " << at;
  }
}

// tcp's cancel fence (docs/design.md): a write posted after cancel() while
// frames of the cancelled write are unacknowledged waits behind them; when the
// peer dies meanwhile, that write fails at once instead of waiting for
// acknowledgements that will never come.
TEST_F(TransferTest, TcpRequestHeldByTheCancelFenceFailsWhenThePeerDies) {
  constexpr uint64_t kLen = 64 << 20;
  ASSERT_NO_FATAL_FAILURE(Connect(kLen));
  auto routes = engine_->peer_transports(pid_);
  ASSERT_TRUE(routes.ok()) << routes.status().to_string();
  bool tcp = false;
  for (const PeerTransportInfo& route : *routes) {
    tcp |= route.connected && route.transport == "tcp" &&
           route.carries.find("host memory") != std::string::npos;
  }
  if (!tcp) GTEST_SKIP() << "host memory is not carried by tcp here";
  LocalBuffer buf(*engine_, kLen);
  std::vector<LocalIov> l(4, LocalIov{buf.data(), kLen});
  std::vector<RemoteIov> r(4, RemoteIov{&peer_->rw, 0, kLen});
  peer_->process().Kill(SIGSTOP);
  auto id = engine_->write_async(pid_, l, r);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  std::this_thread::sleep_for(300ms);  // socket buffers fill: frames sent, none acknowledged
  ASSERT_TRUE(engine_->cancel(*id).ok());
  LocalBuffer small(*engine_, 4096);
  LocalIov sl{small.data(), 4096};
  RemoteIov sr{&peer_->rw, 0, 4096};
  auto later = engine_->write_async(pid_, {&sl, 1}, {&sr, 1});
  ASSERT_TRUE(later.ok()) << later.status().to_string();
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(engine_->test(*later).code(), StatusCode::kInProgress);
  peer_->process().Kill(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = engine_->wait(*later, 10s);
  EXPECT_EQ(s.code(), StatusCode::kPeerDisconnected) << s.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST_F(TransferTest, CancelLargeReadStopsWritingLocalMemory) {
  ASSERT_NO_FATAL_FAILURE(Connect(64 << 20));
  constexpr uint64_t kLen = 64 << 20;
  constexpr int kIovs = 4;
  LocalBuffer buf(*engine_, kIovs * kLen);
  std::memset(buf.data(), 0, kIovs * kLen);
  std::vector<LocalIov> l;
  std::vector<RemoteIov> r;
  for (int i = 0; i < kIovs; ++i) {
    l.push_back({buf.data() + i * kLen, kLen});
    r.push_back({&peer_->rw, 0, kLen});
  }
  auto id = engine_->read_async(pid_, l, r);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  ASSERT_TRUE(engine_->cancel(*id).ok());
  const uint64_t after_cancel = HashBytes(buf.data(), kIovs * kLen);
  Status s = engine_->wait(*id, 30s);
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s.to_string();
  // Responses to the cancelled read may still be on the wire. Push more
  // traffic through every stream so they are surely received (and discarded).
  LocalBuffer small(*engine_, 1 << 16);
  for (int i = 0; i < 8; ++i) ASSERT_NO_FATAL_FAILURE(ExpectHealthy(small, 100 + i));
  EXPECT_EQ(HashBytes(buf.data(), kIovs * kLen), after_cancel)
      << "bytes of a cancelled read landed in local memory after cancel() returned";
}

// A write posted after cancel() returned is never overwritten by bytes of the
// cancelled write, which a transport may still have in flight (frames on the
// wire, a target's copy in progress). Every iov of the large write covers the
// same 4 MiB (one shm request each), so any copy of it still running on the
// target when the small write lands covers the small write's bytes too -- at
// the end of the range, which a running copy reaches last. Rounds vary the
// time between the post and cancel(), for about three seconds. Two standalone
// notifications posted right after each cancel() arrive, in order. Before the
// shm transport's cancel fence (docs/design.md), staging mode failed this in
// the first rounds of every run. Over tcp both sides run 4 I/O threads (the
// default on 16 CPUs), so the target places frames of different streams in
// parallel: before tcp's cancel fence this failed in 5 of 5 runs (one I/O
// thread, the default below 8 CPUs, reads its streams in turn and hid it).
TEST_F(TransferTest, CancelledWriteNeverOverwritesALaterWrite) {
  constexpr uint64_t kRange = 4 << 20;
  constexpr uint64_t kSmall = 64 << 10;
  constexpr uint64_t kSmallAt = kRange - kSmall;
  constexpr int kIovs = 256;  // 1 GiB in all
  ASSERT_NO_FATAL_FAILURE(Connect(kRange, {{"tcp.io_threads", "4"}}, {"tcp.io_threads=4"}));
  LocalBuffer big(*engine_, kRange);
  FillPattern(96, 0, big.data(), kRange);
  std::vector<LocalIov> l(kIovs, LocalIov{big.data(), kRange});
  std::vector<RemoteIov> r(kIovs, RemoteIov{&peer_->rw, 0, kRange});
  LocalBuffer small(*engine_, kSmall);
  LocalIov sl{small.data(), kSmall};
  RemoteIov sr{&peer_->rw, kSmallAt, kSmall};
  const auto end = std::chrono::steady_clock::now() + 3s;
  int rounds = 0, cancelled = 0;
  std::vector<double> after_cancel_us;  // the notifications and the write after cancel()
  std::vector<std::string> notes;       // hex payloads of the notifications sent
  for (uint64_t seed = 2000; rounds < 200 && std::chrono::steady_clock::now() < end; ++seed) {
    SCOPED_TRACE("round " + std::to_string(rounds));
    ++rounds;
    auto id = engine_->write_async(pid_, l, r);
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    std::this_thread::sleep_for(std::chrono::microseconds(500 * (rounds % 8)));
    ASSERT_TRUE(engine_->cancel(*id).ok());
    const Status c = engine_->wait(*id, 30s);
    ASSERT_TRUE(c.code() == StatusCode::kCancelled || c.ok()) << c.to_string();
    if (c.code() == StatusCode::kCancelled) ++cancelled;
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 2; ++k) {
      const std::string note = "round " + std::to_string(rounds) + "." + std::to_string(k);
      const ByteView v(reinterpret_cast<const uint8_t*>(note.data()), note.size());
      ASSERT_TRUE(engine_->notify(pid_, v).ok());
      notes.push_back(ToHex(v.data(), v.size()));
    }
    FillPattern(seed, 0, small.data(), kSmall);
    Status s = engine_->write(pid_, {&sl, 1}, {&sr, 1}, std::nullopt, 30s);
    after_cancel_us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    ASSERT_TRUE(s.ok()) << s.to_string();
    // Late copies of the cancelled write take a millisecond or two; give
    // them time to land (they must not) before looking.
    std::this_thread::sleep_for(20ms);
    const auto now = peer_->Checksum(kSmallAt, kSmall);
    ASSERT_EQ(now, PatternHash(seed, 0, kSmall))
        << "the target's bytes of a write posted after cancel() returned were overwritten "
        << (now == PatternHash(96, kSmallAt, kSmall) ? "by the cancelled write's bytes"
                                                     : "in part");
    std::memset(small.data(), 0, kSmall);
    s = engine_->read(pid_, {&sl, 1}, {&sr, 1}, 30s);
    ASSERT_TRUE(s.ok()) << s.to_string();
    size_t bad = 0;
    ASSERT_TRUE(MatchesPattern(seed, 0, small.data(), kSmall, &bad))
        << "read back differs from the write posted after cancel() at byte " << bad;
  }
  EXPECT_GT(cancelled, 0) << "no round caught the large write before it finished";
  const auto got =
      Split(peer_->Command("notifications " + std::to_string(notes.size()) + " 10000"));
  ASSERT_EQ(got.size(), notes.size() + 2) << "expected " << notes.size() << " notifications";
  for (size_t i = 0; i < notes.size(); ++i) {
    const std::string& f = got[i + 2];
    ASSERT_EQ(f.substr(f.find(':') + 1), notes[i]) << "notification " << i << " out of order";
  }
  std::sort(after_cancel_us.begin(), after_cancel_us.end());
  std::printf(
      "%d rounds, %d cancelled before they finished; two notifications and a 64 KiB write "
      "after cancel() took %.0f us (median), %.0f us (max)\n",
      rounds, cancelled, after_cancel_us[after_cancel_us.size() / 2], after_cancel_us.back());
  // Over tcp the fence engaged: requests posted after a cancel() waited
  // behind the cancelled write's unanswered frames (Engine::transports()
  // counters).
  auto routes = engine_->peer_transports(pid_);
  ASSERT_TRUE(routes.ok()) << routes.status().to_string();
  std::string carrier;
  for (const auto& route : *routes) {
    if (route.carries.find("host memory") != std::string::npos) carrier = route.transport;
  }
  for (const auto& t : engine_->transports()) {
    for (const auto& [name, value] : t.counters) {
      if (t.name != "tcp" || name != "fence_held_requests") continue;
      std::printf("tcp: %llu requests held by the cancel fence\n",
                  static_cast<unsigned long long>(value));
      if (carrier == "tcp") {
        EXPECT_GT(value, 0u) << "no request waited behind a cancel fence";
      }
    }
  }
}

TEST_F(TransferTest, ConcurrentThreadsToTwoPeers) {
  constexpr int kThreads = 8;
  constexpr uint64_t kRange = 2 << 20;
  constexpr int kIters = 12;
  auto a = StartPeer({.size = kThreads * kRange, .seed = 11});
  auto b = StartPeer({.size = kThreads * kRange, .seed = 12});
  ASSERT_TRUE(a && b);
  auto engine = MakeEngine();
  ASSERT_TRUE(engine);
  TestPeer* peers[2] = {a.get(), b.get()};
  PeerId ids[2];
  for (int p = 0; p < 2; ++p) {
    auto id = engine->connect(ByteView(peers[p]->metadata));
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids[p] = *id;
  }
  // Each thread: a source and a sink area of its own.
  LocalBuffer buf(*engine, kThreads * 2 * kRange);
  std::atomic<int> failures{0};
  uint64_t last_seed[2][kThreads] = {};
  std::barrier start(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      uint8_t* src = buf.data() + 2 * t * kRange;
      uint8_t* dst = src + kRange;
      std::mt19937_64 rng(t);
      start.arrive_and_wait();
      for (int k = 0; k < kIters; ++k) {
        const int p = (t + k) % 2;
        const uint64_t seed = 50000 + t * 100 + k;
        FillPattern(seed, t * kRange, src, kRange);
        // Split the range into a random number of iovs.
        const size_t n = 1 + rng() % 16;
        std::vector<LocalIov> li, lo;
        std::vector<RemoteIov> ri;
        uint64_t off = 0;
        for (size_t i = 0; i < n; ++i) {
          const uint64_t len = i + 1 == n ? kRange - off : (kRange / n);
          li.push_back({src + off, len});
          lo.push_back({dst + off, len});
          ri.push_back({&peers[p]->rw, t * kRange + off, len});
          off += len;
        }
        Status s;
        if (k % 2) {
          s = engine->write(ids[p], li, ri, std::nullopt, 60s);
        } else {
          auto id = engine->write_async(ids[p], li, ri);
          s = id.ok() ? engine->wait(*id, 60s) : id.status();
        }
        if (!s.ok()) {
          ADD_FAILURE() << "thread " << t << " write " << k << ": " << s.to_string();
          failures++;
          return;
        }
        last_seed[p][t] = seed;
        std::memset(dst, 0, kRange);
        s = engine->read(ids[p], lo, ri, 60s);
        if (!s.ok() || !MatchesPattern(seed, t * kRange, dst, kRange)) {
          ADD_FAILURE() << "thread " << t << " read-back " << k << ": " << s.to_string();
          failures++;
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  for (int p = 0; p < 2; ++p) {
    for (int t = 0; t < kThreads; ++t) {
      const uint64_t want = last_seed[p][t] ? PatternHash(last_seed[p][t], t * kRange, kRange)
                                            : PatternHash(11 + p, t * kRange, kRange);
      EXPECT_EQ(peers[p]->Checksum(t * kRange, kRange), want)
          << "peer " << p << " range of thread " << t;
    }
  }
}

TEST_F(TransferTest, TheTargetCanInitiateToo) {
  // The test engine is the target here; the peer process connects to it.
  ASSERT_NO_FATAL_FAILURE(Connect(1 << 20));
  Buffer mine(1 << 20);
  FillPattern(303, 0, mine.data(), 1 << 20);
  auto region = engine_->register_memory(mine.data(), 1 << 20);
  ASSERT_TRUE(region.ok());
  auto d = engine_->advertise(region->id);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  const std::string reply = peer_->Command("connect " + ToHex(engine_->metadata()));
  ASSERT_EQ(reply, "OK " + Hex64(engine_->id()));
  const std::string desc = ToHex(d->to_bytes());
  const std::string me = Hex64(engine_->id());
  // The peer writes pattern 404 into [4096, +65536) of our memory...
  ASSERT_EQ(peer_->Command("write " + me + " " + desc + " 4096 65536 404"), "OK");
  EXPECT_TRUE(MatchesPattern(404, 4096, mine.data() + 4096, 65536));
  EXPECT_TRUE(MatchesPattern(303, 0, mine.data(), 4096));
  EXPECT_TRUE(MatchesPattern(303, 4096 + 65536, mine.data() + 4096 + 65536, 1000));
  // ...and reads our pattern back.
  EXPECT_EQ(peer_->Command("read " + me + " " + desc + " 100000 5000"),
            "OK " + Hex64(PatternHash(303, 100000, 5000)));
  (void)engine_->deregister_memory(region->id);
}

TEST_F(TransferTest, BatchLimitsAndArgumentErrors) {
  ASSERT_NO_FATAL_FAILURE(Connect(1 << 20));
  LocalBuffer buf(*engine_, 1 << 20);
  FillPattern(808, 0, buf.data(), 1 << 20);
  // 1,000,000 one-byte iovs in one call: the largest batch allowed.
  constexpr size_t kMaxBatch = 1'000'000;
  std::vector<LocalIov> l(kMaxBatch);
  std::vector<RemoteIov> r(kMaxBatch);
  for (size_t i = 0; i < kMaxBatch; ++i) {
    l[i] = {buf.data() + i, 1};
    r[i] = {&peer_->rw, i, 1};
  }
  Status s = engine_->write(pid_, l, r, std::nullopt, 120s);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(peer_->Checksum(0, kMaxBatch), HashBytes(buf.data(), kMaxBatch));
  // And read them back mirrored: local byte i from remote byte N-1-i.
  Buffer mirror_src(kMaxBatch);
  std::memcpy(mirror_src.data(), buf.data(), kMaxBatch);
  std::memset(buf.data(), 0, kMaxBatch);
  for (size_t i = 0; i < kMaxBatch; ++i) r[i].offset = kMaxBatch - 1 - i;
  s = engine_->read(pid_, l, r, 120s);
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (size_t i = 0; i < kMaxBatch; ++i) {
    if (buf.data()[i] != mirror_src.data()[kMaxBatch - 1 - i]) {
      ADD_FAILURE() << "mirrored read: local byte " << i << " is wrong";
      break;
    }
  }
  for (size_t i = 0; i < kMaxBatch; ++i) r[i].offset = i;
  const uint64_t before = *peer_->Checksum(0, 1 << 20);
  LocalIov zero{buf.data(), 0};
  RemoteIov zero_r{&peer_->rw, 0, 0};
  s = engine_->write(pid_, {&zero, 1}, {&zero_r, 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "zero-length iov: " << s.to_string();

  l.push_back({buf.data(), 1});
  r.push_back({&peer_->rw, 0, 1});
  s = engine_->write(pid_, l, r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "1,000,001 iovs: " << s.to_string();
  s = engine_->write(pid_, {}, {});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "empty batch: " << s.to_string();
  LocalIov one{buf.data(), 8};
  RemoteIov other{&peer_->rw, 0, 16};
  s = engine_->write(pid_, {&one, 1}, {&other, 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "length mismatch: " << s.to_string();
  s = engine_->write(pid_, {&one, 1}, std::span<const RemoteIov>(&other, 0));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "count mismatch: " << s.to_string();
  RemoteIov none{nullptr, 0, 8};
  s = engine_->write(pid_, {&one, 1}, {&none, 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "no descriptor: " << s.to_string();
  // Local memory that is not registered.
  std::vector<uint8_t> unregistered(64);
  LocalIov stray{unregistered.data(), 8};
  RemoteIov ok8{&peer_->rw, 0, 8};
  s = engine_->write(pid_, {&stray, 1}, {&ok8, 1});
  EXPECT_FALSE(s.ok()) << "write from unregistered local memory accepted";
  s = engine_->read(pid_, {&stray, 1}, {&ok8, 1});
  EXPECT_FALSE(s.ok()) << "read into unregistered local memory accepted";
  // Unknown peer.
  s = engine_->write(pid_ ^ 1, {&one, 1}, {&ok8, 1});
  EXPECT_FALSE(s.ok()) << "write to an unknown peer accepted";
  EXPECT_EQ(peer_->Checksum(0, 1 << 20), before) << "a refused call changed the target";
}

}  // namespace
}  // namespace ferry::itest
