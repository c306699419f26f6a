// The per-peer transport choice between processes of one host, and the shm
// transport's own cases: which transport carries what and why, batches of 1
// to 100,000 iovs verified in the target's memory (by cross-memory attach and
// through the shared-memory staging mode), the host id standing for two
// hosts, forcing tcp, and cross-memory attach refused by the kernel (shm then
// runs in staging mode).
//
// The engine-level suites (transfer, notification, refusal, peer failure) run
// over shm already (the automatic choice here), again with tcp forced and
// again with shm in staging mode (FERRY_SHM_MODE=staging).
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <numeric>

#include "fixture.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;

// Empty when `engine` runs the shm transport, else why not.
std::string ShmMissing(Engine& engine) {
  for (const TransportInfo& t : engine.transports()) {
    if (t.name == "shm") return t.running ? "" : t.detail;
  }
  return "the engine does not run shm (engine.transports excludes it)";
}

const PeerTransportInfo* Find(const std::vector<PeerTransportInfo>& routes, std::string_view name) {
  for (const auto& r : routes) {
    if (r.transport == name) return &r;
  }
  return nullptr;
}

// A network transport (tcp, or fabric where libfabric runs here: it ranks
// before tcp) carries host memory.
bool NetworkCarriesHost(const std::vector<PeerTransportInfo>& routes) {
  for (const auto& r : routes) {
    if (r.transport != "shm" && r.transport != "cuda_ipc" &&
        r.carries.find("host memory") != std::string::npos) {
      return true;
    }
  }
  return false;
}

std::string Describe(const std::vector<PeerTransportInfo>& routes) {
  std::string out;
  for (const auto& r : routes) {
    out += r.transport + (r.connected ? " up" : " down") + " carries '" + r.carries + "' (" +
           r.reason + "); ";
  }
  return out;
}

// How the shm transport moves bytes to `peer`, as an engine that runs shm
// alone reports it (Engine::peer_address gives the shm connection's own
// description there: "pid … via …, cross-memory attach" or "…, shared memory
// (…)").
std::string ShmMode(const TestPeer& peer, std::map<std::string, std::string> options = {}) {
  options["engine.transports"] = "shm";
  auto engine = MakeEngine(std::move(options));
  if (!engine) return "no engine";
  auto p = engine->connect(ByteView(peer.metadata));
  if (!p.ok()) return "connect failed: " + p.status().to_string();
  auto address = engine->peer_address(*p);
  return address.ok() ? *address : address.status().to_string();
}

class SameHost : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* forced = std::getenv("FERRY_ENGINE_TRANSPORTS");
    if (forced && std::string(forced) != "auto") {
      GTEST_SKIP() << "FERRY_ENGINE_TRANSPORTS=" << forced << " decides the transports";
    }
    const char* mode = std::getenv("FERRY_SHM_MODE");
    if (mode && std::string(mode) != "auto") {
      GTEST_SKIP() << "FERRY_SHM_MODE=" << mode << " decides how shm moves bytes";
    }
    auto probe = MakeEngine();
    ASSERT_TRUE(probe);
    const std::string why = ShmMissing(*probe);
    if (!why.empty()) GTEST_SKIP() << "shm transport unavailable here: " << why;
  }

  void Connect(uint64_t peer_size, std::map<std::string, std::string> options = {},
               std::vector<std::string> wrapper = {}) {
    peer_ = StartPeer({.size = peer_size, .seed = 3, .wrapper = std::move(wrapper)});
    ASSERT_TRUE(peer_);
    engine_ = MakeEngine(std::move(options));
    ASSERT_TRUE(engine_);
    auto p = engine_->connect(ByteView(peer_->metadata));
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    pid_ = *p;
    auto routes = engine_->peer_transports(pid_);
    ASSERT_TRUE(routes.ok()) << routes.status().to_string();
    routes_ = *routes;
  }

  // `n` blocks of `block` bytes, local block i written to remote block
  // n-1-i (scattered both ways), checked in the target's memory, then read
  // back in the same scattered order and compared byte for byte.
  void WriteReadScattered(size_t n, uint64_t block, uint64_t seed) {
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
    EXPECT_EQ(peer_->Checksum(0, total), HashBytes(expected.data(), total))
        << "target memory after a write of " << n << " x " << block << " B";
    s = engine_->read(pid_, lb, r, 60s);
    ASSERT_TRUE(s.ok()) << n << " x " << block << ": " << s.to_string();
    EXPECT_EQ(std::memcmp(back.data(), src.data(), total), 0)
        << "read-back of " << n << " x " << block << " B differs";
  }

  std::unique_ptr<TestPeer> peer_;
  std::unique_ptr<Engine> engine_;
  PeerId pid_ = 0;
  std::vector<PeerTransportInfo> routes_;
};

TEST_F(SameHost, ShmCarriesHostMemoryAndSaysSo) {
  ASSERT_NO_FATAL_FAILURE(Connect(1 << 20));
  const auto* shm = Find(routes_, "shm");
  const auto* tcp = Find(routes_, "tcp");
  ASSERT_TRUE(shm && tcp) << Describe(routes_);
  EXPECT_TRUE(shm->connected) << Describe(routes_);
  EXPECT_EQ(shm->carries, "host memory") << Describe(routes_);
  EXPECT_TRUE(tcp->connected) << Describe(routes_);
  EXPECT_EQ(tcp->carries.find("host"), std::string::npos) << Describe(routes_);
  EXPECT_NE(tcp->reason.find("shm carries host memory"), std::string::npos) << Describe(routes_);
  // Shm runs first in the preference order.
  const auto all = engine_->transports();
  ASSERT_GE(all.size(), 2u);
  EXPECT_EQ(all[0].name, "shm");
  EXPECT_TRUE(all[0].same_host_only);
  // The target sees the peer over shm too, and initiates over it.
  const std::string me = Hex64(engine_->id());
  ASSERT_EQ(peer_->Command("connect " + ToHex(engine_->metadata())), "OK " + me);
  const std::string carriers = peer_->Command("carriers " + me);
  EXPECT_EQ(carriers.rfind("OK shm", 0), 0u) << carriers;
}

TEST_F(SameHost, BatchesOfOneToOneHundredThousandIovs) {
  ASSERT_NO_FATAL_FAILURE(Connect(16 << 20));
  ASSERT_EQ(Find(routes_, "shm")->carries, "host memory") << Describe(routes_);
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(1, 4096, 11));
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(1, (8 << 20) + 13, 12));  // chunked on the target
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(10, 4096, 13));
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(1000, 4096, 14));
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(3000, 3, 15));  // odd sizes, several requests
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(100000, 64, 16));
}

TEST_F(SameHost, StagingModeMovesEveryByteAndSaysSo) {
  // shm.mode=staging on this side only: the peer (auto) follows, and the
  // bytes pass through the two shared-memory areas, pipelined through a
  // small one here.
  ASSERT_NO_FATAL_FAILURE(
      Connect(16 << 20, {{"shm.mode", "staging"}, {"shm.staging_bytes", "2MiB"}}));
  const auto* shm = Find(routes_, "shm");
  ASSERT_TRUE(shm) << Describe(routes_);
  EXPECT_TRUE(shm->connected) << Describe(routes_);
  EXPECT_EQ(shm->carries, "host memory") << Describe(routes_);
  const std::string mode = ShmMode(*peer_, {{"shm.mode", "staging"}});
  EXPECT_NE(mode.find("shared memory (shm.mode=staging on this engine)"), std::string::npos)
      << mode;
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(1, 4096, 41));
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(1, (8 << 20) + 13, 42));  // 16 requests in 2 MiB
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(10, 4096, 43));
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(1000, 4096, 44));
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(3000, 3, 45));
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(100000, 64, 46));
  // The peer initiates over the same staged connection.
  const std::string me = Hex64(engine_->id());
  ASSERT_EQ(peer_->Command("connect " + ToHex(engine_->metadata())), "OK " + me);
  const std::string carriers = peer_->Command("carriers " + me);
  EXPECT_EQ(carriers.rfind("OK shm", 0), 0u) << carriers;
}

TEST_F(SameHost, ForcedModesThatConflictLeaveHostMemoryToTcpAndSayWhy) {
  // shm.mode=cma here and staging on the peer: no common way; the connect
  // fails naming both, and tcp carries host memory (never silently).
  peer_ = StartPeer({.size = 1 << 20, .seed = 3, .engine_options = {"shm.mode=staging"}});
  ASSERT_TRUE(peer_);
  engine_ = MakeEngine({{"shm.mode", "cma"}});
  ASSERT_TRUE(engine_);
  auto p = engine_->connect(ByteView(peer_->metadata));
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  auto routes = engine_->peer_transports(*p);
  ASSERT_TRUE(routes.ok());
  const auto* shm = Find(*routes, "shm");
  ASSERT_TRUE(shm) << Describe(*routes);
  EXPECT_FALSE(shm->connected) << Describe(*routes);
  EXPECT_NE(shm->reason.find("shm.mode is staging on engine"), std::string::npos)
      << Describe(*routes);
  EXPECT_NE(shm->reason.find("and cma on engine"), std::string::npos) << Describe(*routes);
  EXPECT_TRUE(NetworkCarriesHost(*routes)) << Describe(*routes);
}

TEST_F(SameHost, AnotherHostIdStandsForTwoHosts) {
  ASSERT_NO_FATAL_FAILURE(Connect(1 << 20, {{"engine.host_id", "rack7-node3"}}));
  const auto* shm = Find(routes_, "shm");
  ASSERT_TRUE(shm) << Describe(routes_);
  EXPECT_FALSE(shm->connected) << Describe(routes_);
  EXPECT_NE(shm->reason.find("another host"), std::string::npos) << Describe(routes_);
  EXPECT_NE(shm->reason.find("rack7-node3"), std::string::npos) << Describe(routes_);
  EXPECT_TRUE(NetworkCarriesHost(routes_)) << Describe(routes_);
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(64, 4096, 21));
}

TEST_F(SameHost, ForcingTcpRunsTcpAlone) {
  ASSERT_NO_FATAL_FAILURE(Connect(1 << 20, {{"engine.transports", "tcp"}}));
  ASSERT_EQ(routes_.size(), 1u) << Describe(routes_);
  EXPECT_EQ(routes_[0].transport, "tcp");
  EXPECT_NE(routes_[0].carries.find("host"), std::string::npos) << Describe(routes_);
  const auto all = engine_->transports();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].name, "tcp");
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(64, 4096, 22));
}

TEST(SameHostConfig, UnknownOrUnusableSelectionsAreErrors) {
  EngineConfig c;
  c.options = {{"engine.transports", "tcp,warp"}};
  auto e = Engine::create(c);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("'warp'"), std::string::npos) << e.status().to_string();
  c.options = {{"engine.transports", " , "}};
  e = Engine::create(c);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << e.status().to_string();
  auto engine = Engine::create({});
  ASSERT_TRUE(engine.ok());
  auto unknown = (*engine)->peer_transports(0x1234);
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("0000000000001234"), std::string::npos)
      << unknown.status().to_string();
}

TEST_F(SameHost, CrossMemoryAttachRefusedRunsShmThroughSharedMemory) {
  // The peer runs as another user (nobody): it may not attach to this
  // process, the kernel's ptrace check says so at the probe, and shm runs in
  // staging mode -- host memory still goes over shm, and the connection says
  // why it does not use cross-memory attach.
  if (geteuid() != 0) GTEST_SKIP() << "needs root to start the peer as another user";
  std::string out;
  auto check = ChildProcess::Spawn({"setpriv", "--help"}, &out, true);
  if (!check || !check->Wait(10s)) GTEST_SKIP() << "setpriv (util-linux) is not available";
  if (access(TestPeerPath().c_str(), X_OK) != 0) GTEST_SKIP() << "peer binary not executable";
  ASSERT_NO_FATAL_FAILURE(
      Connect(16 << 20, {}, {"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"}));
  const auto* shm = Find(routes_, "shm");
  ASSERT_TRUE(shm) << Describe(routes_);
  EXPECT_TRUE(shm->connected) << Describe(routes_);
  EXPECT_EQ(shm->carries, "host memory") << Describe(routes_);
  EXPECT_FALSE(NetworkCarriesHost(routes_)) << Describe(routes_);
  const std::string mode = ShmMode(*peer_);
  if (mode.find("shared memory") == std::string::npos) {
    GTEST_SKIP() << "the kernel let user 65534 attach to a root process here: " << mode;
  }
  EXPECT_NE(mode.find("shared memory (CMA refused: "), std::string::npos) << mode;
  EXPECT_NE(mode.find("cross-memory attach"), std::string::npos) << mode;
  EXPECT_NE(mode.find("EPERM"), std::string::npos) << mode;
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(1, (8 << 20) + 13, 31));
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(256, 4096, 32));
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(100000, 64, 33));
}

TEST_F(SameHost, CrossMemoryAttachRequiredButRefusedFallsBackToTcpAndSaysWhy) {
  // The same refusal with shm.mode=cma: no staging, so the connection is not
  // used and a network transport (tcp, or fabric where it runs) carries host
  // memory, with the kernel's reason.
  if (geteuid() != 0) GTEST_SKIP() << "needs root to start the peer as another user";
  std::string out;
  auto check = ChildProcess::Spawn({"setpriv", "--help"}, &out, true);
  if (!check || !check->Wait(10s)) GTEST_SKIP() << "setpriv (util-linux) is not available";
  if (access(TestPeerPath().c_str(), X_OK) != 0) GTEST_SKIP() << "peer binary not executable";
  ASSERT_NO_FATAL_FAILURE(
      Connect(1 << 20, {{"shm.mode", "cma"}},
              {"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"}));
  const auto* shm = Find(routes_, "shm");
  ASSERT_TRUE(shm) << Describe(routes_);
  if (shm->connected) {
    GTEST_SKIP() << "the kernel let user 65534 attach to a root process here: "
                 << Describe(routes_);
  }
  EXPECT_NE(shm->reason.find("cross-memory attach"), std::string::npos) << Describe(routes_);
  EXPECT_NE(shm->reason.find("EPERM"), std::string::npos) << Describe(routes_);
  EXPECT_TRUE(NetworkCarriesHost(routes_)) << Describe(routes_);
  ASSERT_NO_FATAL_FAILURE(WriteReadScattered(256, 4096, 34));
}

}  // namespace
}  // namespace ferry::itest
