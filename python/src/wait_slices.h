// Blocking waits called from Python run in slices of at most kWaitSlice, each
// with the GIL released; between slices the caller takes the GIL back to run
// PyErr_CheckSignals, so Ctrl-C raises KeyboardInterrupt promptly.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "status_error.h"

namespace ferry_py {

constexpr std::chrono::milliseconds kWaitSlice{50};

// A timeout in seconds as milliseconds (rounded up); InvalidArgument when it
// is negative or NaN; a huge or infinite one becomes "longer than any wait".
inline std::chrono::milliseconds to_ms(double seconds) {
  if (!(seconds >= 0)) raise(ferry::StatusCode::kInvalidArgument, "timeout must be >= 0 seconds");
  const double ms = std::ceil(seconds * 1000.0);
  if (ms > 1e15) return std::chrono::milliseconds(std::numeric_limits<int64_t>::max() / 2000000);
  return std::chrono::milliseconds(static_cast<int64_t>(ms));
}

// The end of a wait with an optional timeout (seconds; none: no end).
class WaitDeadline {
 public:
  using Clock = std::chrono::steady_clock;

  explicit WaitDeadline(std::optional<double> timeout_s)
      : bounded_(timeout_s.has_value()),
        end_(bounded_ ? Clock::now() + to_ms(*timeout_s) : Clock::time_point::max()) {}

  // The next slice: kWaitSlice, or what is left of the timeout if less.
  std::chrono::milliseconds next_slice() const {
    if (!bounded_) return kWaitSlice;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end_ - Clock::now());
    return std::clamp(left, std::chrono::milliseconds(0), kWaitSlice);
  }

  bool passed() const { return bounded_ && Clock::now() >= end_; }

 private:
  bool bounded_;
  Clock::time_point end_;
};

}  // namespace ferry_py
