// N member processes forked from a parent that never touches CUDA, each
// running the same function with its rank, and an all-gather of bytes between
// them through the parent (over socketpairs): how the symmetric-memory tests
// and bench/device_api exchange cards, as an application would with its own
// launcher. A member reports "" (passed), "SKIP: why" or what failed.
#pragma once

#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace gputest {

class Member {
 public:
  Member(int rank, int size, int fd) : rank_(rank), size_(size), fd_(fd) {}
  int rank() const { return rank_; }
  int size() const { return size_; }
  // Every member calls it the same number of times; returns each member's bytes by rank.
  std::vector<std::vector<uint8_t>> all_gather(const std::vector<uint8_t>& mine) const {
    send_frame(fd_, mine);
    std::vector<std::vector<uint8_t>> all(static_cast<size_t>(size_));
    for (auto& b : all) {
      if (!recv_frame(fd_, &b)) std::_Exit(3);
    }
    return all;
  }
  void barrier() const { all_gather({}); }

  static void send_frame(int fd, const std::vector<uint8_t>& b) {
    const uint64_t n = b.size();
    write_all(fd, &n, sizeof n);
    write_all(fd, b.data(), b.size());
  }
  static bool recv_frame(int fd, std::vector<uint8_t>* b) {
    uint64_t n = 0;
    if (!read_all(fd, &n, sizeof n)) return false;
    b->resize(n);
    return read_all(fd, b->data(), n);
  }

 private:
  static void write_all(int fd, const void* p, size_t n) {
    const auto* c = static_cast<const char*>(p);
    while (n > 0) {
      const ssize_t w = ::write(fd, c, n);
      if (w <= 0) std::_Exit(3);
      c += w;
      n -= static_cast<size_t>(w);
    }
  }
  static bool read_all(int fd, void* p, size_t n) {
    auto* c = static_cast<char*>(p);
    while (n > 0) {
      const ssize_t r = ::read(fd, c, n);
      if (r <= 0) return false;
      c += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }

  int rank_, size_, fd_;
};

// Runs `body` in `size` forked processes; returns each member's report.
inline std::vector<std::string> run_members(int size,
                                            const std::function<std::string(Member&)>& body) {
  std::vector<int> parent_fds, report_fds;
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    int sv[2], rp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0 || pipe(rp) != 0) {
      return {"socketpair/pipe failed: " + std::string(strerror(errno))};
    }
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      ::close(sv[0]);
      ::close(rp[0]);
      for (int fd : parent_fds) ::close(fd);
      Member m(r, size, sv[1]);
      std::string report;
      try {
        report = body(m);
      } catch (const std::exception& e) {
        report = std::string("exception: ") + e.what();
      }
      Member::send_frame(rp[1], std::vector<uint8_t>(report.begin(), report.end()));
      std::fflush(nullptr);
      std::_Exit(0);
    }
    ::close(sv[1]);
    ::close(rp[1]);
    parent_fds.push_back(sv[0]);
    report_fds.push_back(rp[0]);
    pids.push_back(pid);
  }
  // The hub: one frame from each member in rank order, then all of them to each.
  std::thread hub([&] {
    for (;;) {
      std::vector<std::vector<uint8_t>> round(static_cast<size_t>(size));
      for (int r = 0; r < size; ++r) {
        if (!Member::recv_frame(parent_fds[static_cast<size_t>(r)],
                                &round[static_cast<size_t>(r)])) {
          // A member left: the others' all_gather must fail rather than wait forever.
          for (int fd : parent_fds) ::shutdown(fd, SHUT_RDWR);
          return;
        }
      }
      for (int r = 0; r < size; ++r) {
        for (const auto& b : round) Member::send_frame(parent_fds[static_cast<size_t>(r)], b);
      }
    }
  });
  std::vector<std::string> reports(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    std::vector<uint8_t> b;
    if (Member::recv_frame(report_fds[static_cast<size_t>(r)], &b)) {
      reports[static_cast<size_t>(r)].assign(b.begin(), b.end());
    } else {
      reports[static_cast<size_t>(r)] = "member " + std::to_string(r) + " died without a report";
    }
    int status = 0;
    waitpid(pids[static_cast<size_t>(r)], &status, 0);
  }
  // Every member has exited: its end of the socketpair is closed, the hub returns.
  for (int fd : parent_fds) ::shutdown(fd, SHUT_RDWR);
  hub.join();
  for (int fd : parent_fds) ::close(fd);
  for (int fd : report_fds) ::close(fd);
  return reports;
}

}  // namespace gputest
