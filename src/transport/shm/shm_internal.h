// Pieces the shm transport's files share: the clock, the I/O thread's epoll
// tags, socket helpers of the handshake and the I/O thread.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fmt/format.h"
#include "transport/shm/shm_transport.h"

namespace ferry::shm::internal {

using Clock = std::chrono::steady_clock;

inline constexpr uint64_t kWakeTag = 0;
inline constexpr uint64_t kListenTag = 1;
inline constexpr auto kHandshakeCheck = std::chrono::milliseconds(100);

inline std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

inline int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX));
}

// Waits until `fd` is ready for `events` or the deadline passes.
inline Status wait_ready(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, ms_left(deadline));
    if (r > 0) return Status::Ok();
    if (r == 0) return err::Timeout(fmt::format("{} timed out", what));
    if (errno != EINTR) return err::Internal(fmt::format("poll: {}", errno_text(errno)));
  }
}

// Sends all of `data` on a non-blocking socket before `deadline`.
inline Status send_all(int fd, ByteView data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n =
        ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (Status s = wait_ready(fd, POLLOUT, deadline, "send"); !s.ok()) return s;
      continue;
    }
    return err::PeerDisconnected(fmt::format("send failed: {}", errno_text(errno)));
  }
  return Status::Ok();
}

inline constexpr size_t kMaxFdsPerRecv = 4;

// One recvmsg: bytes into `out`, descriptors appended to *fds. Returns what
// recv would, or -2 (errno EPROTO) when descriptors were cut off.
inline ssize_t recv_with_fds(int fd, uint8_t* out, size_t n, std::vector<int>* fds) {
  iovec iov{out, n};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRecv)];
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control;
  m.msg_controllen = sizeof control;
  const ssize_t r = ::recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (r < 0) return r;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int received;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds->push_back(received);
    }
  }
  if ((m.msg_flags & MSG_CTRUNC) != 0) {
    errno = EPROTO;
    return -2;
  }
  return r;
}

// The peer's pid as this process's pid namespace sees it (the kernel
// translates it), 0 when it is not visible there; never a pid the peer claims.
inline Result<pid_t> peer_pid(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return err::Internal(fmt::format("shm: SO_PEERCRED failed: {}", errno_text(errno)));
  }
  // 0: the peer lives in a pid namespace this one cannot see into (a
  // container beside ours, or our parent's when we are the contained one).
  // Cross-memory attach then cannot reach it -- the probe says so -- and the
  // connection stages bytes through shared memory, which needs no pid.
  return cred.pid > 0 ? cred.pid : 0;
}

}  // namespace ferry::shm::internal
