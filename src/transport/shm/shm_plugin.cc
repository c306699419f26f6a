// Registers the shm transport with core. Rank 10: a same-host transport,
// preferred over the network ones (rank 100) for host memory.
#include "transport/shm/shm_transport.h"

namespace ferry::shm {
namespace {
const bool kRegistered =
    register_transport({"shm", 10, [] { return std::unique_ptr<Transport>(new ShmTransport()); },
                        std::span<const OptionSpec>(kShmOptionSpecs, kShmOptionSpecCount)});
}  // namespace
}  // namespace ferry::shm
