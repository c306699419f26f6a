// Registers the tcp transport with core.
#include "transport/tcp/tcp_transport.h"

namespace ferry::tcp {
namespace {
const bool kRegistered =
    register_transport({"tcp", 100, [] { return std::unique_ptr<Transport>(new TcpTransport()); },
                        std::span<const OptionSpec>(kTcpOptionSpecs, kTcpOptionSpecCount)});
}  // namespace
}  // namespace ferry::tcp
