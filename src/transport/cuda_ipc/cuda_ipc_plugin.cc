// Registers the cuda_ipc transport with core. Rank 5: same-host GPU memory
// before every other transport that could carry it.
#include "transport/cuda_ipc/cuda_ipc_transport.h"

namespace ferry::cuda_ipc {
namespace {
const bool kRegistered = register_transport(
    {"cuda_ipc", 5, [] { return std::unique_ptr<Transport>(new CudaIpcTransport()); },
     std::span<const OptionSpec>(kCudaIpcOptionSpecs, kCudaIpcOptionSpecCount)});
}  // namespace
}  // namespace ferry::cuda_ipc
