// The per-peer route choice of TransportSet (core/transport_set.h) with two
// stand-in transports: "route_net" ranked like fabric (carries host memory,
// local GPU memory only where every remote side is host memory, and the
// peer's GPU memory only for peers that say so: capabilities_for), and
// "route_tcp" ranked like tcp (carries every kind).
#include <gtest/gtest.h>

#include <set>

#include "core/transport_set.h"

namespace ferry {
namespace {

constexpr PeerId kPlainPeer = 0x1111;  // no FI_HMEM on its side
constexpr PeerId kHmemPeer = 0x2222;   // registers GPU memory with FI_HMEM

class StandIn : public Transport {
 public:
  explicit StandIn(bool net) : net_(net) {}
  std::string_view name() const override { return net_ ? "route_net" : "route_tcp"; }
  TransportCaps capabilities() const override {
    TransportCaps c;
    c.cuda_memory = true;
    c.local_gpu_only = net_;
    c.varies_by_peer = net_;
    return c;
  }
  TransportCaps capabilities_for(PeerId peer) const override {
    TransportCaps c = capabilities();
    if (net_ && peer == kHmemPeer) c.local_gpu_only = false;
    return c;
  }
  std::string peer_limits(PeerId peer) const override {
    return net_ && peer != kHmemPeer ? "peer GPU memory: no FI_HMEM on the peer" : "";
  }
  Status start(const TransportContext&) override { return Status::Ok(); }
  void shutdown(const Status&) override {}
  Bytes local_address() const override { return {}; }
  std::string local_address_text() const override { return std::string(name()); }
  Result<PeerId> connect(ByteView, PeerId) override { return err::NotSupported("stand-in"); }
  bool is_connected(PeerId peer) const override { return peer == kPlainPeer || peer == kHmemPeer; }
  std::string peer_address(PeerId) const override { return "here"; }
  Status post_write(PeerId, const std::shared_ptr<Transfer>&, std::vector<Segment>) override {
    return err::NotSupported("stand-in");
  }
  Status post_read(PeerId, const std::shared_ptr<Transfer>&, std::vector<Segment>) override {
    return err::NotSupported("stand-in");
  }
  Status post_notification(PeerId, const std::shared_ptr<Transfer>&, Bytes) override {
    return err::NotSupported("stand-in");
  }
  void cancel(Transfer&) override {}

 private:
  bool net_;
};

class NoEvents : public TransportEvents {
 public:
  void on_notification(PeerId, Bytes) override {}
  void on_peer_up(PeerId) override {}
  void on_peer_down(PeerId, const Status&) override {}
};

const bool kRegistered =
    register_transport(
        {"route_net", 50, [] { return std::unique_ptr<Transport>(new StandIn(true)); }, {}}) &&
    register_transport(
        {"route_tcp", 100, [] { return std::unique_ptr<Transport>(new StandIn(false)); }, {}});

class TransportRoute : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kRegistered);
    Status s = set_.start("route_tcp,route_net", TransportContext{},
                          [](std::string_view) { return std::make_unique<NoEvents>(); });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  void TearDown() override { set_.shutdown(err::Cancelled("test over")); }
  std::string chosen(PeerId peer, MemoryRoute route, bool host_pairs, bool peer_gpu) {
    auto t = set_.choose(peer, route, host_pairs, peer_gpu);
    return t.ok() ? std::string((*t)->name()) : "none: " + t.status().message();
  }
  TransportSet set_;
};

TEST_F(TransportRoute, HostMemoryTakesTheLowerRank) {
  EXPECT_EQ(chosen(kPlainPeer, MemoryRoute::kHostOnly, false, false), "route_net");
  EXPECT_EQ(chosen(kHmemPeer, MemoryRoute::kHostOnly, false, false), "route_net");
}

TEST_F(TransportRoute, LocalGpuToPeerHostStaysOnTheFabricWithOrWithoutPeerHmem) {
  // Every remote side host memory (host pairs in the batch too): staged.
  EXPECT_EQ(chosen(kPlainPeer, MemoryRoute::kGpuToPeerHost, false, false), "route_net");
  EXPECT_EQ(chosen(kPlainPeer, MemoryRoute::kGpuToPeerHost, true, false), "route_net");
  EXPECT_EQ(chosen(kHmemPeer, MemoryRoute::kGpuToPeerHost, true, false), "route_net");
}

TEST_F(TransportRoute, PeerGpuMemoryNeedsHmemOnThePeer) {
  EXPECT_EQ(chosen(kPlainPeer, MemoryRoute::kPeerGpu, false, true), "route_tcp");
  EXPECT_EQ(chosen(kHmemPeer, MemoryRoute::kPeerGpu, false, true), "route_net");
}

TEST_F(TransportRoute, MixedBatchWithSomePeerGpuMemoryGoesWhereAllOfItCan) {
  // Some iovs local GPU -> peer host, some -> peer GPU: the route is
  // kGpuToPeerHost, but the peer's GPU memory rules the fabric out there.
  EXPECT_EQ(chosen(kPlainPeer, MemoryRoute::kGpuToPeerHost, false, true), "route_tcp");
  EXPECT_EQ(chosen(kHmemPeer, MemoryRoute::kGpuToPeerHost, false, true), "route_net");
}

TEST_F(TransportRoute, PeerTransportsSayWhy) {
  bool seen = false;
  for (const PeerTransportInfo& info : set_.describe_peer(kPlainPeer)) {
    if (info.transport != "route_net") continue;
    seen = true;
    EXPECT_TRUE(info.connected);
    EXPECT_EQ(info.carries, "host memory, local GPU with peer host memory");
    EXPECT_NE(info.reason.find("no FI_HMEM on the peer"), std::string::npos) << info.reason;
  }
  EXPECT_TRUE(seen);
  for (const PeerTransportInfo& info : set_.describe_peer(kHmemPeer)) {
    if (info.transport == "route_net") {
      EXPECT_EQ(info.carries, "host memory, peer GPU memory, local GPU with peer host memory");
    }
    if (info.transport == "route_tcp") {
      EXPECT_EQ(info.carries, "");
    }
  }
}

}  // namespace
}  // namespace ferry
