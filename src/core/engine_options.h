// The engine's own option table (DESIGN.md §7); each transport declares its
// own beside it (transport/transport.h registry).
#pragma once

#include <vector>

#include "core/options.h"

namespace ferry {

inline constexpr const char* kPeerWindowBytesOption = "engine.peer_window_bytes";
inline constexpr const char* kNotificationQueueBytesOption = "engine.notification_queue_bytes";
inline constexpr const char* kPeerWindowIovsOption = "engine.peer_window_iovs";
inline constexpr const char* kPeerWindowWaitOption = "engine.peer_window_wait_ms";

// The engine's options followed by those of every registered transport.
std::vector<OptionSpec> all_option_specs();

}  // namespace ferry
