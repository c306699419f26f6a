// Registers the fabric transport with core. Rank 50: across hosts, before tcp
// (100); after the same-host transports (cuda_ipc 5, shm 10).
#include "transport/fabric/fabric_transport.h"

namespace ferry::fabric {
namespace {
const bool kRegistered = register_transport(
    {"fabric", 50, [] { return std::unique_ptr<Transport>(new FabricTransport()); },
     std::span<const OptionSpec>(kFabricOptionSpecs, kFabricOptionSpecCount)});
}  // namespace
}  // namespace ferry::fabric
