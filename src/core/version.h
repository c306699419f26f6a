// Library and wire protocol versions.
#pragma once

#include <cstdint>

// The library version comes from the build: project(ferry VERSION x.y.z) in
// the top-level CMakeLists.txt, the one place it is written, reaches the
// compiler as FERRY_VERSION_STRING (src/CMakeLists.txt, on target ferry and
// everything in the tree that links it).
#ifndef FERRY_VERSION_STRING
#error "FERRY_VERSION_STRING is not defined: build with CMake, linking target ferry"
#endif

namespace ferry {
inline constexpr const char* kLibraryVersion = FERRY_VERSION_STRING;
// Bumped on any incompatible change of the wire format of any transport.
inline constexpr uint16_t kProtocolVersion = 1;
}  // namespace ferry
