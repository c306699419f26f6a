// A build without libfabric's headers: fabric is still a known name (so
// `engine.transports=fabric` says why it cannot run), and it never starts.
#include "transport/common/unavailable_transport.h"

namespace ferry {
namespace {

std::unique_ptr<Transport> create() {
  TransportCaps caps;
  caps.metadata_only = true;
  return std::make_unique<UnavailableTransport>(
      "fabric", caps,
      "fabric: this build of Ferry has no libfabric support (libfabric-dev was not installed "
      "at build time)");
}

const bool kRegistered = register_transport({"fabric", 50, &create, {}});

}  // namespace
}  // namespace ferry
