// Whether an I/O thread should poll (epoll_wait with a zero timeout) instead
// of sleeping: during a window after an event that asked for it, and only
// while polling does not take a core another thread needs.
//
// On 2 CPUs with two CPU hogs, a target that polled after each request made
// blocking 4 KiB tcp writes 45 -> 167-209 us p50 in some runs; with these
// checks 18-46 us, as without polling (docs/benchmarks.md, "tcp: the target
// polls after serving a request"). So the thread stops polling for kBackoff
// when
//  - a poll round that found nothing took far longer than one system call
//    (the thread was descheduled), or
//  - the machine has more runnable threads than CPUs to run them (read from
//    /proc/loadavg at most every kCrowdCheck while polling; where it cannot be
//    read, this check is off).
#pragma once

#include <chrono>
#include <cstdint>

namespace ferry {

// Threads runnable on the machine now (/proc/loadavg), or -1 if unknown.
int runnable_threads();

class SpinWindow {
 public:
  using Clock = std::chrono::steady_clock;
  // An idle round longer than this was not one system call.
  static constexpr std::chrono::microseconds kDescheduled{50};
  static constexpr std::chrono::milliseconds kBackoff{20};
  static constexpr std::chrono::milliseconds kCrowdCheck{5};

  // cpus: what this process may run on (usable_cpus()).
  explicit SpinWindow(uint32_t cpus) : cpus_(static_cast<int>(cpus)) {}

  // Poll until at least now + window.
  void arm(Clock::time_point now, Clock::duration window) {
    if (now + window > until_) until_ = now + window;
  }
  bool spinning(Clock::time_point now) {
    if (now >= until_ || now < backoff_until_) return false;
    if (now >= next_crowd_check_) {
      next_crowd_check_ = now + kCrowdCheck;
      // One more than the CPUs: this thread and a caller spinning in wait().
      if (const int r = runnable_threads(); r > cpus_ + 1) {
        back_off(now);
        return false;
      }
    }
    return true;
  }
  // After a poll round that found nothing, begun at `start`.
  void idle_round(Clock::time_point start, Clock::time_point end) {
    if (end - start > kDescheduled) back_off(end);
  }
  // How often polling was stopped (descheduled or crowded).
  uint64_t backoffs() const { return backoffs_; }

 private:
  void back_off(Clock::time_point now) {
    backoff_until_ = now + kBackoff;
    until_ = Clock::time_point{};
    ++backoffs_;
  }
  int cpus_;
  Clock::time_point until_{};
  Clock::time_point backoff_until_{};
  Clock::time_point next_crowd_check_{};
  uint64_t backoffs_ = 0;
};

}  // namespace ferry
