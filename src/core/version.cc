#include "core/version.h"

#include "ferry/engine.h"

namespace ferry {

std::string_view version() {
  return kLibraryVersion;
}

uint16_t protocol_version() {
  return kProtocolVersion;
}

}  // namespace ferry
