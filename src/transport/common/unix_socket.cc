#include "transport/common/unix_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fmt/format.h"

namespace ferry::unix_socket {
namespace {

Result<sockaddr_un> address_of(const std::string& path, const char* who) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.empty() || path.size() > kMaxPath) {
    return err::InvalidArgument(fmt::format("{}: socket path '{}' is {} bytes (allowed 1 to {})",
                                            who, path, path.size(), kMaxPath));
  }
  std::memcpy(a.sun_path, path.data(), path.size());
  return a;
}

}  // namespace

std::string errno_text(int err) {
  char buf[128];
  const char* name = strerrorname_np(err);
  return fmt::format("{} ({})", strerror_r(err, buf, sizeof buf),
                     name ? name : fmt::format("errno {}", err));
}

Result<int> listen_at(const std::string& path, const char* who) {
  auto address = address_of(path, who);
  if (!address.ok()) return address.status();
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return err::Internal(fmt::format("{}: socket(AF_UNIX): {}", who, errno_text(errno)));
  ::unlink(path.c_str());
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&*address), sizeof(sockaddr_un)) != 0 ||
      ::listen(fd, 128) != 0) {
    const int e = errno;
    ::close(fd);
    return err::NotSupported(fmt::format("{}: cannot listen on {}: {}", who, path, errno_text(e)));
  }
  return fd;
}

Result<int> connect_to(const std::string& path, std::chrono::milliseconds timeout,
                       const char* who) {
  auto address = address_of(path, who);
  if (!address.ok()) return address.status();
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return err::Internal(fmt::format("{}: socket(AF_UNIX): {}", who, errno_text(errno)));
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&*address), sizeof(sockaddr_un));
  if (rc != 0 && (errno == EAGAIN || errno == EINPROGRESS)) {
    // A full backlog: wait for the listener to take us, bounded.
    pollfd p{fd, POLLOUT, 0};
    rc = ::poll(&p, 1, static_cast<int>(timeout.count()));
    int so_error = 0;
    socklen_t len = sizeof so_error;
    if (rc == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) == 0 && so_error == 0) {
      rc = 0;
    } else {
      errno = rc == 0 ? ETIMEDOUT : (so_error != 0 ? so_error : errno);
      rc = -1;
    }
  }
  if (rc != 0) {
    const int e = errno;
    ::close(fd);
    return err::PeerDisconnected(
        fmt::format("{}: cannot connect to {}: {}", who, path, errno_text(e)));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

Result<pid_t> peer_pid(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return err::Internal(fmt::format("SO_PEERCRED: {}", errno_text(errno)));
  }
  return cred.pid;
}

void set_send_timeout(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

Status send_all(int fd, std::span<const uint8_t> bytes, std::span<const int> fds) {
  if (fds.size() > kMaxFdsPerMessage) {
    return err::InvalidArgument(
        fmt::format("{} descriptors in one message (at most {})", fds.size(), kMaxFdsPerMessage));
  }
  size_t sent = 0;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  while (sent < bytes.size()) {
    iovec iov{const_cast<uint8_t*>(bytes.data() + sent), bytes.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (sent == 0 && !fds.empty()) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      if (e == EAGAIN || e == EWOULDBLOCK) {
        return err::Timeout("the peer did not drain its control socket within the send timeout");
      }
      return err::PeerDisconnected(fmt::format("send on the control socket: {}", errno_text(e)));
    }
    sent += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Result<ssize_t> receive(int fd, std::span<uint8_t> buffer, std::vector<int>* fds) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 253)];
  iovec iov{buffer.data(), buffer.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return ssize_t{-1};
    return err::PeerDisconnected(
        fmt::format("receive on the control socket: {}", errno_text(errno)));
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int d;
      std::memcpy(&d, CMSG_DATA(c) + i * sizeof(int), sizeof d);
      fds->push_back(d);
    }
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    return err::ProtocolError("the peer sent more descriptors in one message than allowed (253)");
  }
  return n;
}

}  // namespace ferry::unix_socket
