#include "core/log_sink.h"

#include <mutex>

#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace ferry {

void log_to_stderr() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto current = spdlog::default_logger();
    if (current && !current->name().empty()) return;  // the application's choice
    auto logger = spdlog::get("ferry");
    if (!logger) logger = spdlog::stderr_color_mt("ferry");
    spdlog::set_default_logger(logger);
  });
}

}  // namespace ferry
