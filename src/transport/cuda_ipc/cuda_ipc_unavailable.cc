// A build without the CUDA toolkit: cuda_ipc is still a known name (so
// `engine.transports=cuda_ipc` says why it cannot run, instead of "no such
// transport"), and it never starts.
#include "transport/common/unavailable_transport.h"

namespace ferry {
namespace {

std::unique_ptr<Transport> create() {
  TransportCaps caps;
  caps.host_memory = false;
  caps.cuda_memory = true;
  caps.cuda_peer_only = true;
  caps.gpu_to_peer_host = true;
  caps.same_host_only = true;
  return std::make_unique<UnavailableTransport>(
      "cuda_ipc", caps, "cuda_ipc: this build of Ferry has no CUDA support");
}

const bool kRegistered = register_transport({"cuda_ipc", 5, &create, {}});

}  // namespace
}  // namespace ferry
