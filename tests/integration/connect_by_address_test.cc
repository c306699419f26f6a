// Connect by host:port between two processes of one host: the tcp handshake
// carries both engines' metadata (handshake revision 2), so the connection
// reaches every transport connect(metadata) reaches -- shm carries host
// memory, both ways -- and says so in peer_transports(). A peer speaking
// the handshake of engines before revision 2 (tcp.handshake_revision=1)
// still connects, over tcp, and the reason says why shm is not used. Every
// byte is checked in the other process's memory.
#include "fixture.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;

const PeerTransportInfo* Find(const std::vector<PeerTransportInfo>& routes, std::string_view name) {
  for (const auto& r : routes) {
    if (r.transport == name) return &r;
  }
  return nullptr;
}

std::string Describe(const std::vector<PeerTransportInfo>& routes) {
  std::string out;
  for (const auto& r : routes) {
    out += r.transport + (r.connected ? " up" : " down") + " carries '" + r.carries + "' (" +
           r.reason + "); ";
  }
  return out;
}

class ConnectByAddress : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* forced = std::getenv("FERRY_ENGINE_TRANSPORTS");
    if (forced && std::string(forced) != "auto") {
      GTEST_SKIP() << "FERRY_ENGINE_TRANSPORTS=" << forced << " decides the transports";
    }
    auto probe = MakeEngine();
    ASSERT_TRUE(probe);
    for (const TransportInfo& t : probe->transports()) {
      if (t.name == "shm" && !t.running) GTEST_SKIP() << "shm does not run here: " << t.detail;
    }
  }

  // Connects engine_ to peer_ by its listen address; fills routes_.
  void Connect(std::map<std::string, std::string> options = {},
               std::vector<std::string> peer_options = {}) {
    peer_ = StartPeer({.size = 16 << 20, .seed = 3, .engine_options = std::move(peer_options)});
    ASSERT_TRUE(peer_);
    engine_ = MakeEngine(std::move(options));
    ASSERT_TRUE(engine_);
    auto p = engine_->connect(std::string_view(peer_->listen));
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    ASSERT_EQ(*p, peer_->engine_id);
    pid_ = *p;
    auto routes = engine_->peer_transports(pid_);
    ASSERT_TRUE(routes.ok()) << routes.status().to_string();
    routes_ = *routes;
  }

  // `n` blocks of `block` bytes written to scattered remote blocks, checked
  // in the peer's memory, read back and compared.
  void WriteRead(size_t n, uint64_t block, uint64_t seed) {
    const uint64_t total = n * block;
    LocalBuffer src(*engine_, total);
    LocalBuffer back(*engine_, total);
    FillPattern(seed, 0, src.data(), total);
    std::vector<LocalIov> l(n), lb(n);
    std::vector<RemoteIov> r(n);
    Buffer expected(total);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t remote_off = (n - 1 - i) * block;
      l[i] = {src.data() + i * block, block};
      lb[i] = {back.data() + i * block, block};
      r[i] = {&peer_->rw, remote_off, block};
      std::memcpy(expected.data() + remote_off, src.data() + i * block, block);
    }
    Status s = engine_->write(pid_, l, r, std::nullopt, 60s);
    ASSERT_TRUE(s.ok()) << n << " x " << block << ": " << s.to_string();
    EXPECT_EQ(peer_->Checksum(0, total), HashBytes(expected.data(), total));
    s = engine_->read(pid_, lb, r, 60s);
    ASSERT_TRUE(s.ok()) << n << " x " << block << ": " << s.to_string();
    EXPECT_EQ(std::memcmp(back.data(), src.data(), total), 0);
  }

  // The peer (which accepted) writes its pattern into our memory and reads
  // it back, without connecting itself; returns what carried host memory.
  std::string PeerInitiates(uint64_t seed) {
    const std::string me = Hex64(engine_->id());
    const std::string carriers = peer_->Command("carriers " + me);
    LocalBuffer mine(*engine_, 1 << 20);
    auto d = engine_->advertise(mine.region(), 0, 1 << 20, kAccessReadWrite);
    EXPECT_TRUE(d.ok()) << d.status().to_string();
    if (!d.ok()) return carriers;
    const std::string desc = ToHex(d->to_bytes());
    // The peer fills [4097, +300000) of its buffer with pattern `seed` and
    // writes it to the same offset here; then reads it back.
    EXPECT_EQ(peer_->Command("write " + me + " " + desc + " 4097 300000 " + std::to_string(seed)),
              "OK");
    EXPECT_TRUE(MatchesPattern(seed, 4097, mine.data() + 4097, 300000));
    EXPECT_EQ(peer_->Command("read " + me + " " + desc + " 4097 300000"),
              "OK " + Hex64(PatternHash(seed, 4097, 300000)));
    return carriers;
  }

  std::unique_ptr<TestPeer> peer_;
  std::unique_ptr<Engine> engine_;
  PeerId pid_ = 0;
  std::vector<PeerTransportInfo> routes_;
};

TEST_F(ConnectByAddress, ShmCarriesHostMemoryBothWays) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const auto* shm = Find(routes_, "shm");
  const auto* tcp = Find(routes_, "tcp");
  ASSERT_TRUE(shm && tcp) << Describe(routes_);
  EXPECT_TRUE(shm->connected) << Describe(routes_);
  EXPECT_EQ(shm->carries, "host memory") << Describe(routes_);
  EXPECT_TRUE(tcp->connected) << Describe(routes_);
  EXPECT_NE(tcp->reason.find("shm carries host memory"), std::string::npos) << Describe(routes_);
  ASSERT_NO_FATAL_FAILURE(WriteRead(1, 4096, 11));
  ASSERT_NO_FATAL_FAILURE(WriteRead(1, (8 << 20) + 13, 12));
  ASSERT_NO_FATAL_FAILURE(WriteRead(1000, 4096, 13));
  // The accepting side initiates over shm as well.
  const std::string carriers = PeerInitiates(14);
  EXPECT_EQ(carriers.rfind("OK shm", 0), 0u) << carriers;
  // Connecting again by address finds everything connected and changes nothing.
  auto again = engine_->connect(std::string_view(peer_->listen));
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(*again, pid_);
  ASSERT_NO_FATAL_FAILURE(WriteRead(64, 4096, 15));
}

TEST_F(ConnectByAddress, TheSameChoiceAsConnectByMetadata) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto by_meta = MakeEngine();
  ASSERT_TRUE(by_meta);
  auto p = by_meta->connect(ByteView(peer_->metadata));
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  auto expected = by_meta->peer_transports(*p);
  ASSERT_TRUE(expected.ok());
  ASSERT_EQ(expected->size(), routes_.size()) << Describe(*expected) << " vs " << Describe(routes_);
  for (size_t i = 0; i < routes_.size(); ++i) {
    EXPECT_EQ(routes_[i].transport, (*expected)[i].transport);
    EXPECT_EQ(routes_[i].connected, (*expected)[i].connected)
        << Describe(routes_) << " vs " << Describe(*expected);
    EXPECT_EQ(routes_[i].carries, (*expected)[i].carries)
        << Describe(routes_) << " vs " << Describe(*expected);
  }
}

TEST_F(ConnectByAddress, PeerWithTheOldHandshakeConnectsOverTcpAndSaysWhy) {
  // The peer speaks handshake revision 1 (as engines before revision 2): no
  // metadata comes, so only tcp connects, and shm's reason says why.
  ASSERT_NO_FATAL_FAILURE(Connect({}, {"tcp.handshake_revision=1"}));
  const auto* shm = Find(routes_, "shm");
  const auto* tcp = Find(routes_, "tcp");
  ASSERT_TRUE(shm && tcp) << Describe(routes_);
  EXPECT_FALSE(shm->connected) << Describe(routes_);
  EXPECT_NE(shm->reason.find("handshake revision 1"), std::string::npos) << Describe(routes_);
  EXPECT_NE(shm->reason.find(peer_->listen), std::string::npos) << Describe(routes_);
  EXPECT_TRUE(tcp->connected) << Describe(routes_);
  EXPECT_NE(tcp->carries.find("host memory"), std::string::npos) << Describe(routes_);
  ASSERT_NO_FATAL_FAILURE(WriteRead(64, 4096, 21));
  ASSERT_NO_FATAL_FAILURE(WriteRead(1, (4 << 20) + 7, 22));
  const std::string carriers = PeerInitiates(23);
  EXPECT_EQ(carriers.rfind("OK tcp", 0), 0u) << carriers;
}

TEST_F(ConnectByAddress, OldHandshakeOnTheConnectingSideConnectsOverTcp) {
  ASSERT_NO_FATAL_FAILURE(Connect({{"tcp.handshake_revision", "1"}}));
  const auto* shm = Find(routes_, "shm");
  ASSERT_TRUE(shm) << Describe(routes_);
  EXPECT_FALSE(shm->connected) << Describe(routes_);
  EXPECT_NE(shm->reason.find("handshake revision 1"), std::string::npos) << Describe(routes_);
  ASSERT_NO_FATAL_FAILURE(WriteRead(64, 4096, 31));
}

TEST_F(ConnectByAddress, AnotherHostIdKeepsSameHostTransportsOut) {
  // The handshake's metadata is judged as metadata passed by hand: another
  // host id means no same-host transport, and the reason names it.
  ASSERT_NO_FATAL_FAILURE(Connect({{"engine.host_id", "rack7-node3"}}));
  const auto* shm = Find(routes_, "shm");
  ASSERT_TRUE(shm) << Describe(routes_);
  EXPECT_FALSE(shm->connected) << Describe(routes_);
  EXPECT_NE(shm->reason.find("another host"), std::string::npos) << Describe(routes_);
  ASSERT_NO_FATAL_FAILURE(WriteRead(64, 4096, 41));
}

TEST_F(ConnectByAddress, ForcedTcpStaysTcp) {
  ASSERT_NO_FATAL_FAILURE(Connect({{"engine.transports", "tcp"}}));
  ASSERT_EQ(routes_.size(), 1u) << Describe(routes_);
  EXPECT_TRUE(routes_[0].connected);
  ASSERT_NO_FATAL_FAILURE(WriteRead(64, 4096, 51));
}

}  // namespace
}  // namespace ferry::itest
