// A build without the CUDA toolkit: cuda_ipc is still a known name (so
// `engine.transports=cuda_ipc` says why it cannot run, instead of "no such
// transport"), and it never starts.
#include "transport/transport.h"

namespace ferry {
namespace {

class CudaIpcUnavailable final : public Transport {
 public:
  std::string_view name() const override { return "cuda_ipc"; }
  TransportCaps capabilities() const override {
    TransportCaps c;
    c.host_memory = false;
    c.cuda_memory = true;
    c.cuda_peer_only = true;
    c.same_host_only = true;
    return c;
  }
  Status start(const TransportContext&) override {
    return err::NotSupported("cuda_ipc: this build of Ferry has no CUDA support");
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
    {"cuda_ipc", 5, [] { return std::unique_ptr<Transport>(new CudaIpcUnavailable()); }, {}});

}  // namespace
}  // namespace ferry
