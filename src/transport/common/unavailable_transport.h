// A transport this build of Ferry leaves out (no CUDA toolkit, no libfabric
// headers) is still a known name: `engine.transports=<name>` then says why it
// cannot run instead of "no such transport". It never starts; every call that
// would need it answers NotSupported with the reason.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace ferry {

class UnavailableTransport final : public Transport {
 public:
  // `caps` are the left-out transport's, so that the engine reports what it
  // would have carried.
  UnavailableTransport(std::string name, TransportCaps caps, std::string reason)
      : name_(std::move(name)), caps_(caps), reason_(std::move(reason)) {}

  std::string_view name() const override { return name_; }
  TransportCaps capabilities() const override { return caps_; }
  Status start(const TransportContext&) override { return err::NotSupported(reason_); }
  void shutdown(const Status&) override {}
  Bytes local_address() const override { return {}; }
  std::string local_address_text() const override { return {}; }
  Result<PeerId> connect(ByteView, PeerId) override { return err::NotSupported(reason_); }
  bool is_connected(PeerId) const override { return false; }
  std::string peer_address(PeerId) const override { return {}; }
  Status post_write(PeerId, const std::shared_ptr<Transfer>&, std::vector<Segment>) override {
    return err::NotSupported(reason_);
  }
  Status post_read(PeerId, const std::shared_ptr<Transfer>&, std::vector<Segment>) override {
    return err::NotSupported(reason_);
  }
  Status post_notification(PeerId, const std::shared_ptr<Transfer>&, Bytes) override {
    return err::NotSupported(reason_);
  }
  void cancel(Transfer&) override {}

 private:
  const std::string name_;
  const TransportCaps caps_;
  const std::string reason_;
};

}  // namespace ferry
