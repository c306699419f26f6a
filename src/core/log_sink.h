// Where Ferry's log lines go.
#pragma once

namespace ferry {

// spdlog's default logger writes to stdout, which belongs to the application
// (ferry-bench --json, a user's own output). Makes a "ferry" logger on stderr
// the default, unless the application installed a named logger of its own.
// Once per process; safe from any thread.
void log_to_stderr();

}  // namespace ferry
