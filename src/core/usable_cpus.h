// How many CPUs this process may run on: the size of its affinity mask (what
// taskset, cgroups' cpusets and container runtimes leave it), else the online
// CPUs. Transports size their threads by it and decide whether waiting threads
// may spin: spinning pays only where the other side has a core of its own.
#pragma once

#include <cstdint>

namespace ferry {

uint32_t usable_cpus();

}  // namespace ferry
