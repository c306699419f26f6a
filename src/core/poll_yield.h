// engine.test_yield: a caller that polls a large transfer with test() in a
// loop (NIXL's check_xfer_state) gives its core up to the threads that copy
// the transfer, where cores are few (docs/benchmarks.md, "The poller's core").
#pragma once

#include <string>

#include "ferry/status.h"

namespace ferry {

// "auto" (on with fewer than 8 usable CPUs), "true" or "false"; anything else
// is refused naming the option and its choices.
Result<bool> parse_test_yield(const std::string& value);

// test() of a running transfer that transport threads copy: one sched_yield,
// which returns at once where nothing else waits for this core.
void yield_to_copiers();

// test() of a finished transfer: where this thread yielded since it last
// slept, one sleep of ~1 us. Each yield that let another thread run moved
// this thread's place in the scheduler's queue (EEVDF: its deadline) a time
// slice back, and only a sleep puts it back: without one, every thread that
// wakes on this core afterwards runs first, and this thread's next small
// transfers wait for them (blocking 4 KiB p99 ~60 us instead of ~5).
void settle_after_yields();

}  // namespace ferry
