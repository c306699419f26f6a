#include "core/poll_yield.h"

#include <sched.h>
#include <sys/prctl.h>
#include <time.h>

#include <cstdint>

#include "core/options.h"
#include "core/usable_cpus.h"
#include "fmt/format.h"

namespace ferry {
namespace {

// The yield pays where a polling caller and the threads that copy its
// transfer share few cores (2 CPUs through NIXL's API: KV pages 7.1 -> 10.5
// GB/s); with more cores nothing waits for the caller's, and the sleep after
// it would only add time.
constexpr uint32_t kTestYieldMaxCpus = 7;

// Whether this thread gave its core up since it last slept.
thread_local bool t_yielded = false;

}  // namespace

Result<bool> parse_test_yield(const std::string& value) {
  if (value == "auto") return usable_cpus() <= kTestYieldMaxCpus;
  auto b = parse_bool(value);
  if (!b.ok()) {
    return err::InvalidArgument(
        fmt::format("option engine.test_yield: '{}' is none of auto, true, false", value));
  }
  return *b;
}

void yield_to_copiers() {
  sched_yield();
  t_yielded = true;
}

void settle_after_yields() {
  if (!t_yielded) return;
  t_yielded = false;
  // The default timer slack (50 us) would stretch the ~1 us sleep: lowered
  // for it, then put back.
  const int slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
  (void)prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0);
  const timespec brief{0, 1000};
  (void)nanosleep(&brief, nullptr);
  if (slack > 0) (void)prctl(PR_SET_TIMERSLACK, slack, 0, 0, 0);
}

}  // namespace ferry
