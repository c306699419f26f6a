// Waits until a SIGSTOPped test process has really stopped. kill() returns
// once the signal is queued; a loaded process may still run for a while, and
// a test that needs the peer frozen (nothing it does may complete) must not
// go on before that.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace ferry::itest {

// True once every thread of `pid` shows 'T' (stopped) in /proc/pid/task/*/stat,
// within `limit`.
inline bool WaitAllThreadsStopped(pid_t pid, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  do {
    bool all = true, any = false;
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
      std::ifstream in(task.path() / "stat");
      std::string line;
      std::getline(in, line);
      const size_t close = line.rfind(')');  // the command name may hold spaces
      any = true;
      if (close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'T') {
        all = false;
        break;
      }
    }
    if (any && all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  } while (std::chrono::steady_clock::now() < deadline);
  return false;
}

}  // namespace ferry::itest
