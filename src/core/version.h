// Library and wire protocol versions.
#pragma once

#include <cstdint>

namespace ferry {
inline constexpr const char* kLibraryVersion = "0.1.0";
// Bumped on any incompatible change of the wire format of any transport.
inline constexpr uint16_t kProtocolVersion = 1;
}  // namespace ferry
