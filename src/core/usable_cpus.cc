#include "core/usable_cpus.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>

namespace ferry {

uint32_t usable_cpus() {
  cpu_set_t set;
  long cpus = 0;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
  if (cpus <= 0) cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return static_cast<uint32_t>(std::max<long>(cpus, 1));
}

}  // namespace ferry
