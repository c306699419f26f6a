// A build without libfabric's headers: fabric is still a known name (so
// `engine.transports=fabric` says why it cannot run), and it never starts.
#include "transport/transport.h"

namespace ferry {
namespace {

class FabricUnavailable final : public Transport {
 public:
  std::string_view name() const override { return "fabric"; }
  TransportCaps capabilities() const override {
    TransportCaps c;
    c.metadata_only = true;
    return c;
  }
  Status start(const TransportContext&) override {
    return err::NotSupported(
        "fabric: this build of Ferry has no libfabric support (libfabric-dev was not installed "
        "at build time)");
  }
  void shutdown(const Status&) override {}
  Bytes local_address() const override { return {}; }
  std::string local_address_text() const override { return {}; }
  Result<PeerId> connect(ByteView, PeerId) override { return start({}); }
  bool is_connected(PeerId) const override { return false; }
  std::string peer_address(PeerId) const override { return {}; }
  Status post_write(PeerId, const std::shared_ptr<Transfer>&, std::vector<Segment>) override {
    return start({});
  }
  Status post_read(PeerId, const std::shared_ptr<Transfer>&, std::vector<Segment>) override {
    return start({});
  }
  Status post_notification(PeerId, const std::shared_ptr<Transfer>&, Bytes) override {
    return start({});
  }
  void cancel(Transfer&) override {}
};

const bool kRegistered = register_transport(
    {"fabric", 50, [] { return std::unique_ptr<Transport>(new FabricUnavailable()); }, {}});

}  // namespace
}  // namespace ferry
