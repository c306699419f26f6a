#include "transport/transport.h"

namespace ferry {
namespace {
std::vector<TransportRegistration>& registry() {
  static std::vector<TransportRegistration> r;
  return r;
}
}  // namespace

bool register_transport(TransportRegistration registration) {
  registry().push_back(std::move(registration));
  return true;
}

const std::vector<TransportRegistration>& registered_transports() { return registry(); }

const TransportRegistration* find_transport(std::string_view name) {
  for (const auto& r : registry()) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

}  // namespace ferry
