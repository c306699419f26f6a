// Lines between the coordinator and the processes it starts: a child reads
// commands on stdin and writes replies and reports on stdout, one line each.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <optional>
#include <string>

namespace ferry::soak {

// Writes whole lines to stdout from any thread.
class LineWriter {
 public:
  void Write(const std::string& line) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string s = line + "\n";
    for (size_t off = 0; off < s.size();) {
      const ssize_t n = ::write(1, s.data() + off, s.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;  // the coordinator is gone; PR_SET_PDEATHSIG ends us
      off += static_cast<size_t>(n);
    }
  }

 private:
  std::mutex mu_;
};

// Reads lines from stdin; nullopt after `timeout_ms` without one; `eof` set
// when stdin closed.
class LineReader {
 public:
  std::optional<std::string> Read(int timeout_ms, bool* eof) {
    for (;;) {
      const size_t nl = buffered_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffered_.substr(0, nl);
        buffered_.erase(0, nl + 1);
        return line;
      }
      pollfd p{0, POLLIN, 0};
      const int r = ::poll(&p, 1, timeout_ms);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return std::nullopt;
      char buf[65536];
      const ssize_t n = ::read(0, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        *eof = true;
        return std::nullopt;
      }
      buffered_.append(buf, static_cast<size_t>(n));
    }
  }

 private:
  std::string buffered_;
};

}  // namespace ferry::soak
