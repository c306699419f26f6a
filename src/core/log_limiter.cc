#include "core/log_limiter.h"

#include <ctime>

namespace ferry {
namespace {

std::string utc_now_text() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%H:%M:%S UTC", &tm);
  return text;
}

}  // namespace

LogLimiter::LogLimiter(std::string what, uint32_t burst, std::chrono::milliseconds window)
    : what_(std::move(what)), burst_(burst), window_(window) {}

LogLimiter::~LogLimiter() {
  std::lock_guard lock(mu_);
  summarize_locked();
}

void LogLimiter::log(spdlog::level::level_enum level, std::string line) {
  if (!spdlog::default_logger_raw()->should_log(level))
    return;  // neither written nor worth counting
  std::lock_guard lock(mu_);
  const auto now = Clock::now();
  if (window_start_ == Clock::time_point{} || now - window_start_ >= window_) {
    summarize_locked();
    start_window_locked(now);
  }
  if (written_in_window_ < burst_) {
    ++written_in_window_;
    spdlog::log(level, "{}", line);
    return;
  }
  if (held_back_ == 0) first_held_at_ = utc_now_text();
  ++held_back_;
  ++held_back_total_;
  if (level > held_level_) held_level_ = level;
  last_held_ = std::move(line);
}

void LogLimiter::flush_due() {
  std::lock_guard lock(mu_);
  if (held_back_ == 0 || Clock::now() - window_start_ < window_) return;
  summarize_locked();
  start_window_locked(Clock::now());
}

uint64_t LogLimiter::held_back_total() const {
  std::lock_guard lock(mu_);
  return held_back_total_;
}

void LogLimiter::start_window_locked(Clock::time_point now) {
  window_start_ = now;
  written_in_window_ = 0;
}

void LogLimiter::summarize_locked() {
  if (held_back_ == 0) return;
  spdlog::log(held_level_,
              "{}: {} more since {}, not logged one by one (at most {} lines every {} ms); the "
              "last: {}",
              what_, held_back_, first_held_at_, burst_, window_.count(), last_held_);
  held_back_ = 0;
  held_level_ = spdlog::level::trace;
  last_held_.clear();
}

}  // namespace ferry
