// Cross-host test: two network namespaces joined by a veth pair, a target
// ferry_test_peer in one and an initiating ferry_test_peer in the other, so
// every byte crosses a real (virtual) link between two network stacks. The
// namespaces share a kernel, so the engines stand for two hosts by giving
// themselves different host ids (engine.host_id); without that they may
// rightly take the same-host path, which the last test checks.
//
// Only link-local addresses (169.254.77.0/24) inside namespaces this test
// creates are used; nothing is sent on the host's own interfaces. Skipped,
// with the reason, where namespaces cannot be created (not root, no
// CAP_SYS_ADMIN / CAP_NET_ADMIN, no iproute2, no veth). The namespaces are
// deleted at the end whatever happens.
#include "fixture.h"
#include "netns_pair.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;

class CrossNamespace : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = net_.Create();
    if (!why.empty()) GTEST_SKIP() << "cross-host test skipped: " << why;
  }
  // Peers die before the namespaces go (members are destroyed in reverse).
  NetnsPair net_;
};

// Write, read, a refusal and a notification between two "hosts", both ways;
// `carrier` is the transport expected to carry host memory (empty: tcp or
// fabric, whichever runs here -- fabric ranks first).
void MoveAcrossVeth(const NetnsPair& net, const std::string& carrier,
                    const std::vector<std::string>& options) {
  std::vector<std::string> a = options, b = options;
  a.push_back("engine.host_id=host-a");
  b.push_back("engine.host_id=host-b");
  constexpr uint64_t kSize = 64 << 20;
  auto target = StartPeer({.size = kSize,
                           .seed = 1,
                           .listen = NetnsPair::Address(0) + ":0",
                           .engine_options = a,
                           .wrapper = net.Wrapper(0)});
  auto initiator = StartPeer({.size = kSize,
                              .seed = 2,
                              .listen = NetnsPair::Address(1) + ":0",
                              .engine_options = b,
                              .wrapper = net.Wrapper(1)});
  ASSERT_TRUE(target && initiator);
  EXPECT_EQ(target->listen.rfind(NetnsPair::Address(0) + ":", 0), 0u) << target->listen;

  const std::string tid = Hex64(target->engine_id);
  ASSERT_EQ(initiator->Command("connect " + ToHex(target->metadata)), "OK " + tid);
  // Two "hosts": a network transport carries host memory and (with the
  // automatic choice, which runs shm) shm's reason names the other host.
  const std::string carriers = initiator->Command("carriers " + tid);
  if (carrier.empty()) {
    EXPECT_TRUE(carriers.rfind("OK tcp ", 0) == 0 || carriers.rfind("OK fabric ", 0) == 0)
        << carriers;
    EXPECT_NE(carriers.find("is_on_another_host"), std::string::npos) << carriers;
  } else {
    EXPECT_EQ(carriers.rfind("OK " + carrier + " ", 0), 0u) << carriers;
  }
  ASSERT_EQ(initiator->Command("connect_hp " + target->listen), "OK " + tid);

  const std::string rw = ToHex(target->rw.to_bytes());
  // 16 MiB + 5 written at an odd offset, verified in the target's memory.
  const uint64_t off = 1001, len = (16 << 20) + 5;
  ASSERT_EQ(initiator->Command("write " + tid + " " + rw + " " + std::to_string(off) + " " +
                               std::to_string(len) + " 9"),
            "OK");
  EXPECT_EQ(target->Checksum(off, len), PatternHash(9, off, len));
  EXPECT_EQ(target->Checksum(0, off), PatternHash(1, 0, off));
  EXPECT_EQ(target->Checksum(off + len, kSize - off - len),
            PatternHash(1, off + len, kSize - off - len));

  // 32 MiB read of the untouched pattern.
  EXPECT_EQ(initiator->Command("read " + tid + " " + rw + " " + std::to_string(20 << 20) + " " +
                               std::to_string(32 << 20)),
            "OK " + Hex64(PatternHash(1, 20 << 20, 32 << 20)));

  // A refusal crosses too.
  RemoteDescriptor ro = target->ro;
  const std::string reply =
      initiator->Command("write " + tid + " " + ToHex(ro.to_bytes()) + " 0 64 3");
  EXPECT_EQ(reply.rfind("ERR PermissionDenied", 0), 0u) << reply;

  // Notification, with the sender named.
  ASSERT_EQ(initiator->Command("notify " + tid + " 68656c6c6f"), "OK");
  EXPECT_EQ(target->Command("notifications 1 10000"),
            "OK 1 " + Hex64(initiator->engine_id) + ":68656c6c6f");

  // And the other direction over the same link.
  const std::string iid = Hex64(initiator->engine_id);
  ASSERT_EQ(target->Command("connect " + ToHex(initiator->metadata)), "OK " + iid);
  ASSERT_EQ(
      target->Command("write " + iid + " " + ToHex(initiator->rw.to_bytes()) + " 0 1000000 4"),
      "OK");
  EXPECT_EQ(initiator->Checksum(0, 1000000), PatternHash(4, 0, 1000000));
}

TEST_F(CrossNamespace, WriteReadNotifyAcrossVeth) {
  MoveAcrossVeth(net_, "", {});
}

TEST_F(CrossNamespace, TcpAcrossVeth) {
  MoveAcrossVeth(net_, "tcp", {"engine.transports=tcp"});
}

#if FERRY_TEST_FABRIC
// libfabric's tcp;ofi_rxm provider binds where the engine listens: the veth
// address of each namespace.
TEST_F(CrossNamespace, FabricAcrossVeth) {
  MoveAcrossVeth(net_, "fabric", {"engine.transports=fabric,tcp", "fabric.provider=tcp;ofi_rxm"});
}
#endif

TEST_F(CrossNamespace, WildcardListenAdvertisesAReachableAddress) {
  // The target listens on 0.0.0.0: its metadata lists every address of its
  // namespace (127.0.0.1 among them, which in the other namespace reaches
  // nothing); connecting by metadata must find the veth address.
  auto target = StartPeer({.size = 1 << 20,
                           .seed = 1,
                           .listen = "0.0.0.0:0",
                           .engine_options = {"engine.host_id=host-a"},
                           .wrapper = net_.Wrapper(0)});
  auto initiator = StartPeer({.size = 1 << 20,
                              .seed = 2,
                              .listen = NetnsPair::Address(1) + ":0",
                              .engine_options = {"engine.host_id=host-b"},
                              .wrapper = net_.Wrapper(1)});
  ASSERT_TRUE(target && initiator);
  const std::string tid = Hex64(target->engine_id);
  ASSERT_EQ(initiator->Command("connect " + ToHex(target->metadata)), "OK " + tid);
  EXPECT_EQ(initiator->Command("read " + tid + " " + ToHex(target->rw.to_bytes()) + " 0 65536"),
            "OK " + Hex64(PatternHash(1, 0, 65536)));
}

TEST_F(CrossNamespace, ConnectByAddressAcrossVethGetsTheNetwork) {
  // Known only by host:port across the link: the handshake brings the
  // target's metadata, its host id says another host, so host memory goes
  // over the network (tcp, or fabric where it runs) and shm says why not --
  // both ways, the target initiating over the same connection.
  auto target = StartPeer({.size = 16 << 20,
                           .seed = 1,
                           .listen = NetnsPair::Address(0) + ":0",
                           .engine_options = {"engine.host_id=host-a"},
                           .wrapper = net_.Wrapper(0)});
  auto initiator = StartPeer({.size = 16 << 20,
                              .seed = 2,
                              .listen = NetnsPair::Address(1) + ":0",
                              .engine_options = {"engine.host_id=host-b"},
                              .wrapper = net_.Wrapper(1)});
  ASSERT_TRUE(target && initiator);
  const std::string tid = Hex64(target->engine_id);
  const std::string iid = Hex64(initiator->engine_id);
  ASSERT_EQ(initiator->Command("connect_hp " + target->listen), "OK " + tid);
  const std::string carriers = initiator->Command("carriers " + tid);
  EXPECT_TRUE(carriers.rfind("OK tcp ", 0) == 0 || carriers.rfind("OK fabric ", 0) == 0)
      << carriers;
  EXPECT_NE(carriers.find("is_on_another_host"), std::string::npos) << carriers;
  const std::string back = target->Command("carriers " + iid);
  EXPECT_TRUE(back.rfind("OK tcp ", 0) == 0 || back.rfind("OK fabric ", 0) == 0) << back;
  const uint64_t off = 333, len = (8 << 20) + 1;
  ASSERT_EQ(initiator->Command("write " + tid + " " + ToHex(target->rw.to_bytes()) + " " +
                               std::to_string(off) + " " + std::to_string(len) + " 7"),
            "OK");
  EXPECT_EQ(target->Checksum(off, len), PatternHash(7, off, len));
  ASSERT_EQ(
      target->Command("write " + iid + " " + ToHex(initiator->rw.to_bytes()) + " 0 1000000 8"),
      "OK");
  EXPECT_EQ(initiator->Checksum(0, 1000000), PatternHash(8, 0, 1000000));
}

TEST_F(CrossNamespace, OneKernelMayUseTheSameHostPath) {
  // Same boot id, shared /tmp: the namespaces are one host to Ferry, and the
  // shm transport (when it runs here) carries host memory between them.
  auto target = StartPeer({.size = 1 << 20,
                           .seed = 1,
                           .listen = NetnsPair::Address(0) + ":0",
                           .wrapper = net_.Wrapper(0)});
  auto initiator = StartPeer({.size = 1 << 20,
                              .seed = 2,
                              .listen = NetnsPair::Address(1) + ":0",
                              .wrapper = net_.Wrapper(1)});
  ASSERT_TRUE(target && initiator);
  const std::string tid = Hex64(target->engine_id);
  ASSERT_EQ(initiator->Command("connect " + ToHex(target->metadata)), "OK " + tid);
  const std::string carriers = initiator->Command("carriers " + tid);
  ASSERT_EQ(carriers.rfind("OK ", 0), 0u) << carriers;
  if (carriers.find(" shm=") == std::string::npos) {
    GTEST_SKIP() << "the shm transport does not run here: " << carriers;
  }
  EXPECT_EQ(carriers.rfind("OK shm", 0), 0u) << carriers;
  ASSERT_EQ(initiator->Command("write " + tid + " " + ToHex(target->rw.to_bytes()) + " 7 500000 5"),
            "OK");
  EXPECT_EQ(target->Checksum(7, 500000), PatternHash(5, 7, 500000));
  EXPECT_EQ(initiator->Command("read " + tid + " " + ToHex(target->rw.to_bytes()) + " 600000 4096"),
            "OK " + Hex64(PatternHash(1, 600000, 4096)));
}

}  // namespace
}  // namespace ferry::itest
