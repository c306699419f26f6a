// Which machine (kernel) this engine runs on, for the same-host decision.
#pragma once

#include <string>

namespace ferry {

// The kernel's boot id (/proc/sys/kernel/random/boot_id): equal for every
// process of one running kernel, network namespaces and containers included,
// and different after a reboot or on another machine. Empty when unreadable
// (then no same-host transport is chosen).
std::string kernel_boot_id();

}  // namespace ferry
