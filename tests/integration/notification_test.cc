// Notifications: a write's notification is never visible before its data;
// standalone notifications; delivery order; nothing delivered for a refused
// write.
#include <deque>
#include <random>

#include "fixture.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;

struct Received {
  PeerId peer;
  std::string payload;
};

// Parses "OK n peer:hex ..." from the peer's notifications command.
std::optional<std::vector<Received>> Notifications(TestPeer& p, size_t want,
                                                   std::chrono::milliseconds wait) {
  auto f = Split(
      p.Command("notifications " + std::to_string(want) + " " + std::to_string(wait.count())));
  if (f.size() < 2 || f[0] != "OK" || std::stoull(f[1]) + 2 != f.size()) return std::nullopt;
  std::vector<Received> out;
  for (size_t i = 2; i < f.size(); ++i) {
    const auto colon = f[i].find(':');
    if (colon == std::string::npos) return std::nullopt;
    auto bytes = FromHex(f[i].substr(colon + 1));
    if (!bytes) return std::nullopt;
    out.push_back({std::stoull(f[i].substr(0, colon), nullptr, 16),
                   std::string(bytes->begin(), bytes->end())});
  }
  return out;
}

ByteView View(const std::string& s) {
  return ByteView(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

class NotificationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    peer_ = StartPeer({.size = kTargetSize, .seed = 5});
    ASSERT_TRUE(peer_);
  }
  std::unique_ptr<Engine> Connected(std::map<std::string, std::string> options = {}) {
    auto e = MakeEngine(std::move(options));
    if (!e) return nullptr;
    auto p = e->connect(ByteView(peer_->metadata));
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    return p.ok() ? std::move(e) : nullptr;
  }

  // One round: `count` writes of fresh data into distinct slots, each with a
  // notification "OFF LEN HASH", up to `in_flight` at once, while the target
  // checks every notification the moment it sees it.
  void Round(Engine& e, LocalBuffer& src, int round, int count, uint64_t slot, uint64_t min_len,
             size_t in_flight) {
    ASSERT_LE(count * slot, kTargetSize);
    ASSERT_EQ(peer_->Command("watch " + std::to_string(count) + " 60000"), "WATCHING");
    std::mt19937_64 rng(round);
    struct InFlight {
      TransferId id;
      int index;
    };
    std::deque<InFlight> flying;
    std::vector<std::string> payloads(count);
    auto finish_one = [&] {
      Status s = e.wait(flying.front().id, 60s);
      EXPECT_TRUE(s.ok()) << "write " << flying.front().index << ": " << s.to_string();
      flying.pop_front();
    };
    for (int i = 0; i < count; ++i) {
      const uint64_t len = min_len + rng() % (slot - min_len + 1);
      const uint64_t off = i * slot + (slot - len) / 2;  // distinct, never reused this round
      FillPattern(round * 1000 + i, off, src.data() + off, len);
      payloads[i] = std::to_string(off) + " " + std::to_string(len) + " " +
                    Hex64(HashBytes(src.data() + off, len));
      // Up to 3 iovs per write, so one notification covers several pieces.
      std::vector<LocalIov> l;
      std::vector<RemoteIov> r;
      const uint64_t parts = 1 + i % 3;
      for (uint64_t k = 0, done = 0; k < parts; ++k) {
        const uint64_t piece = k + 1 == parts ? len - done : len / parts;
        l.push_back({src.data() + off + done, piece});
        r.push_back({&peer_->wo, off + done, piece});
        done += piece;
      }
      auto id = e.write_async(peer_->engine_id, l, r, View(payloads[i]));
      ASSERT_TRUE(id.ok()) << id.status().to_string();
      flying.push_back({*id, i});
      if (flying.size() >= in_flight) finish_one();
    }
    while (!flying.empty()) finish_one();
    const std::string verdict = peer_->process().ReadLine(90s).value_or("<no answer>");
    EXPECT_EQ(verdict,
              "OK received=" + std::to_string(count) + " good=" + std::to_string(count) + " bad=0")
        << "round " << round;
  }

  static constexpr uint64_t kTargetSize = 64 << 20;
  std::unique_ptr<TestPeer> peer_;
};

TEST_F(NotificationTest, NeverObservedBeforeItsData) {
  // Default striping, then more streams with smaller chunks (more frames per
  // write, on more sockets, so early delivery would show up more often).
  auto plain = Connected();
  auto striped = Connected({{"tcp.streams", "4"}, {"tcp.chunk_bytes", "64KiB"}});
  ASSERT_TRUE(plain && striped);
  LocalBuffer src_a(*plain, kTargetSize);
  LocalBuffer src_b(*striped, kTargetSize);
  int round = 1;
  for (int k = 0; k < 3; ++k) {
    ASSERT_NO_FATAL_FAILURE(Round(*plain, src_a, round++, 40, 1600 << 10, 256 << 10, 8));
    ASSERT_NO_FATAL_FAILURE(Round(*striped, src_b, round++, 40, 1600 << 10, 256 << 10, 8));
  }
  // Large writes: 16 MiB each.
  ASSERT_NO_FATAL_FAILURE(Round(*plain, src_a, round++, 3, 20 << 20, 16 << 20, 3));
  ASSERT_NO_FATAL_FAILURE(Round(*striped, src_b, round++, 3, 20 << 20, 16 << 20, 3));
  // Many small writes, all in flight together.
  ASSERT_NO_FATAL_FAILURE(Round(*striped, src_b, round++, 200, 64 << 10, 1, 64));
}

TEST_F(NotificationTest, StandaloneNotificationsArriveInOrder) {
  auto e = Connected();
  ASSERT_TRUE(e);
  constexpr int kN = 100;
  for (int i = 0; i < kN; ++i) {
    Status s = e->notify(peer_->engine_id, View("note-" + std::to_string(i)));
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  auto got = Notifications(*peer_, kN, 10s);
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->size(), static_cast<size_t>(kN));
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ((*got)[i].payload, "note-" + std::to_string(i));
    EXPECT_EQ((*got)[i].peer, e->id()) << "notification names the wrong sender";
  }
  // take_notifications took them: nothing is left.
  auto rest = Notifications(*peer_, 0, 0ms);
  ASSERT_TRUE(rest.has_value());
  EXPECT_TRUE(rest->empty());
  // Notifications go to the target only.
  EXPECT_TRUE(e->take_notifications().empty());
}

// A target whose application does not take its notifications holds at most
// engine.notification_queue_bytes of them: past that new ones are dropped and
// counted, what it then takes is the first ones in order, and once taken there
// is room again.
TEST_F(NotificationTest, UntakenNotificationsAreBoundedAndTheOverflowIsCounted) {
  auto bounded = StartPeer(
      {.size = 4096, .seed = 9, .engine_options = {"engine.notification_queue_bytes=4096"}});
  ASSERT_TRUE(bounded);
  auto e = MakeEngine();
  ASSERT_TRUE(e);
  ASSERT_TRUE(e->connect(ByteView(bounded->metadata)).ok());
  // 100 B payloads count 164 B each: 24 fit in 4,096 B.
  auto payload = [](int i) {
    std::string s = "note-" + std::to_string(i) + " ";
    s.resize(100, '.');
    return s;
  };
  constexpr int kSent = 60, kFit = 24;
  for (int i = 0; i < kSent; ++i) {
    Status s = e->notify(bounded->engine_id, View(payload(i)));
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  // All of them have arrived once the target counts the overflow.
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  std::string dropped;
  while ((dropped = bounded->Command("dropped_notifications")) !=
             "OK " + std::to_string(kSent - kFit) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(dropped, "OK " + std::to_string(kSent - kFit));
  auto got = Notifications(*bounded, 0, 0ms);
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->size(), static_cast<size_t>(kFit));
  for (int i = 0; i < kFit; ++i) EXPECT_EQ((*got)[i].payload, payload(i));
  // Taken: room again, and nothing more is dropped.
  for (int i = 0; i < 5; ++i)
    ASSERT_TRUE(e->notify(bounded->engine_id, View(payload(100 + i))).ok());
  got = Notifications(*bounded, 5, 10s);
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ((*got)[i].payload, payload(100 + i));
  EXPECT_EQ(bounded->Command("dropped_notifications"), "OK " + std::to_string(kSent - kFit));
}

TEST_F(NotificationTest, WriteNotificationsInterleaveInCallOrder) {
  auto e = Connected();
  ASSERT_TRUE(e);
  LocalBuffer src(*e, 1 << 20);
  FillPattern(9, 0, src.data(), 1 << 20);
  LocalIov l{src.data(), 1 << 20};
  RemoteIov r{&peer_->rw, 0, 1 << 20};
  ASSERT_TRUE(e->notify(peer_->engine_id, View("a")).ok());
  ASSERT_TRUE(e->write(peer_->engine_id, {&l, 1}, {&r, 1}, View("b")).ok());
  ASSERT_TRUE(e->notify(peer_->engine_id, View("c")).ok());
  ASSERT_TRUE(e->write(peer_->engine_id, {&l, 1}, {&r, 1}, View("")).ok());
  ASSERT_TRUE(e->notify(peer_->engine_id, View("d")).ok());
  auto got = Notifications(*peer_, 5, 10s);
  ASSERT_TRUE(got.has_value());
  std::vector<std::string> payloads;
  for (const auto& n : *got) payloads.push_back(n.payload);
  EXPECT_EQ(payloads, (std::vector<std::string>{"a", "b", "c", "", "d"}));
}

TEST_F(NotificationTest, LargePayloadRoundTrips) {
  auto e = Connected();
  ASSERT_TRUE(e);
  Bytes big(64 << 10);
  FillPattern(31, 0, big.data(), big.size());
  ASSERT_TRUE(e->notify(peer_->engine_id, big).ok());
  auto f = Split(peer_->Command("notifications 1 10000"));
  ASSERT_EQ(f.size(), 3u);
  EXPECT_EQ(f[1], "1");
  EXPECT_EQ(f[2], Hex64(e->id()) + ":" + ToHex(big));
}

TEST_F(NotificationTest, NothingDeliveredForWritesWithoutOrRefused) {
  auto e = Connected();
  ASSERT_TRUE(e);
  LocalBuffer src(*e, 1 << 20);
  LocalIov l{src.data(), 4096};
  RemoteIov r{&peer_->rw, 0, 4096};
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(e->write(peer_->engine_id, {&l, 1}, {&r, 1}).ok());
  // A refused write must not deliver its notification (its data was not placed).
  RemoteDescriptor bad_key = peer_->rw;
  bad_key.key ^= 0x10;
  RemoteIov rb{&bad_key, 0, 4096};
  Status s = e->write(peer_->engine_id, {&l, 1}, {&rb, 1}, View("must-not-arrive"));
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  ASSERT_TRUE(e->notify(peer_->engine_id, View("marker")).ok());
  auto got = Notifications(*peer_, 1, 10s);
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->size(), 1u) << "expected only the marker";
  EXPECT_EQ((*got)[0].payload, "marker");
}

}  // namespace
}  // namespace ferry::itest
