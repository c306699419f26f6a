// Bounds the log lines that parties nobody has authenticated can cause.
//
// Anyone who reaches a listen port can open connections and send garbage;
// each one used to write a warning, so a port scan or a flood wrote as many
// lines as it made connections. A LogLimiter writes the first `burst` lines of
// each `window` as they come, counts the rest, and writes one summary for
// them ("N more ... since HH:MM:SS UTC; the last: ...") once the window has
// passed: at the next line, at flush_due() (called periodically by its
// owner), or when it is destroyed.
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace ferry {

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;

  // `what` names the lines in the summary, e.g. "ferry tcp: connections
  // closed for bad input".
  LogLimiter(std::string what, uint32_t burst, std::chrono::milliseconds window);
  ~LogLimiter();  // writes the summary of what it held back, if any
  LogLimiter(const LogLimiter&) = delete;
  LogLimiter& operator=(const LogLimiter&) = delete;

  // Writes `line` at `level` if the window's budget allows, else counts it.
  void log(spdlog::level::level_enum level, std::string line);
  // Writes the summary once the window has passed (cheap when nothing waits).
  void flush_due();

  uint64_t held_back_total() const;  // lines counted but not written, ever

 private:
  void start_window_locked(Clock::time_point now);
  void summarize_locked();

  const std::string what_;
  const uint32_t burst_;
  const std::chrono::milliseconds window_;
  mutable std::mutex mu_;
  Clock::time_point window_start_{};
  uint32_t written_in_window_ = 0;
  uint64_t held_back_ = 0;  // in this window
  uint64_t held_back_total_ = 0;
  spdlog::level::level_enum held_level_ = spdlog::level::trace;  // the highest held back
  std::string first_held_at_;  // wall-clock time of the first line held back
  std::string last_held_;
};

}  // namespace ferry
