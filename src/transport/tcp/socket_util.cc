#include "transport/tcp/socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fmt/format.h"

namespace ferry::tcp {

std::string errno_text(int err) {
  return fmt::format("{} (errno {})", std::strerror(err), err);
}

std::string SocketAddress::to_string() const {
  char host[INET6_ADDRSTRLEN] = "?";
  if (storage.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&storage);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    return fmt::format("{}:{}", host, ntohs(a->sin_port));
  }
  if (storage.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&storage);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    return fmt::format("[{}]:{}", host, ntohs(a->sin6_port));
  }
  return "<unknown address family>";
}

bool SocketAddress::is_wildcard() const {
  if (storage.ss_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr.s_addr == htonl(INADDR_ANY);
  }
  if (storage.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&storage);
    return IN6_IS_ADDR_UNSPECIFIED(&a->sin6_addr);
  }
  return false;
}

uint16_t SocketAddress::port() const {
  if (storage.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
  }
  return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
}

Result<std::vector<SocketAddress>> resolve(std::string_view host_port) {
  std::string host, port;
  if (!host_port.empty() && host_port.front() == '[') {
    const auto close = host_port.find(']');
    if (close == std::string_view::npos || close + 1 >= host_port.size() ||
        host_port[close + 1] != ':') {
      return err::InvalidArgument(fmt::format("'{}' is not [ipv6]:port", host_port));
    }
    host = host_port.substr(1, close - 1);
    port = host_port.substr(close + 2);
  } else {
    const auto colon = host_port.rfind(':');
    if (colon == std::string_view::npos) {
      return err::InvalidArgument(fmt::format("'{}' is not host:port", host_port));
    }
    host = host_port.substr(0, colon);
    port = host_port.substr(colon + 1);
  }
  if (host.empty() || port.empty() || port.find_first_not_of("0123456789") != std::string::npos ||
      port.size() > 5 || std::stoul(port) > 65535) {
    return err::InvalidArgument(fmt::format("'{}' is not host:port (port 0..65535)", host_port));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* list = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &list);
  if (rc != 0) {
    return err::InvalidArgument(
        fmt::format("cannot resolve '{}': {}", host_port, gai_strerror(rc)));
  }
  std::vector<SocketAddress> out;
  for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
    SocketAddress s;
    std::memcpy(&s.storage, a->ai_addr, a->ai_addrlen);
    s.length = a->ai_addrlen;
    out.push_back(s);
  }
  freeaddrinfo(list);
  if (out.empty()) return err::InvalidArgument(fmt::format("'{}' resolves to nothing", host_port));
  return out;
}

Result<int> listen_on(const SocketAddress& address, SocketAddress* bound) {
  const int fd = ::socket(address.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return err::Internal("socket(): " + errno_text(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address.storage), address.length) != 0 ||
      ::listen(fd, 512) != 0) {
    const int e = errno;
    ::close(fd);
    return err::InvalidArgument(
        fmt::format("cannot listen on {}: {}", address.to_string(), errno_text(e)));
  }
  bound->length = sizeof bound->storage;
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound->storage), &bound->length);
  return fd;
}

Result<int> connect_to(const SocketAddress& address, std::chrono::milliseconds timeout) {
  const int fd = ::socket(address.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return err::Internal("socket(): " + errno_text(errno));
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&address.storage), address.length);
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    rc = ::poll(&p, 1, static_cast<int>(timeout.count()));
    if (rc == 0) {
      ::close(fd);
      return err::PeerDisconnected(
          fmt::format("connect to {} timed out after {} ms", address.to_string(), timeout.count()));
    }
    int soerr = 0;
    socklen_t len = sizeof soerr;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
    if (rc < 0) soerr = errno;
    if (soerr != 0) {
      ::close(fd);
      return err::PeerDisconnected(
          fmt::format("connect to {} failed: {}", address.to_string(), errno_text(soerr)));
    }
  } else if (rc != 0) {
    const int e = errno;
    ::close(fd);
    return err::PeerDisconnected(
        fmt::format("connect to {} failed: {}", address.to_string(), errno_text(e)));
  }
  return fd;
}

std::vector<SocketAddress> interface_addresses(int family, uint16_t port) {
  std::vector<SocketAddress> up, loopback;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return {};
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (!i->ifa_addr || !(i->ifa_flags & IFF_UP)) continue;
    const int f = i->ifa_addr->sa_family;
    if (f != AF_INET && !(family == AF_INET6 && f == AF_INET6)) continue;
    SocketAddress s;
    if (f == AF_INET) {
      auto a = *reinterpret_cast<sockaddr_in*>(i->ifa_addr);
      a.sin_port = htons(port);
      std::memcpy(&s.storage, &a, sizeof a);
      s.length = sizeof a;
    } else {
      auto a = *reinterpret_cast<sockaddr_in6*>(i->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&a.sin6_addr)) continue;  // needs a scope id
      a.sin6_port = htons(port);
      std::memcpy(&s.storage, &a, sizeof a);
      s.length = sizeof a;
    }
    ((i->ifa_flags & IFF_LOOPBACK) ? loopback : up).push_back(s);
  }
  freeifaddrs(list);
  up.insert(up.end(), loopback.begin(), loopback.end());
  return up;
}

namespace {
template <typename Op>
Status blocking_io(int fd, size_t n, std::chrono::milliseconds timeout, short events, Op op,
                   const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  size_t done = 0;
  while (done < n) {
    const ssize_t r = op(done);
    if (r > 0) {
      done += static_cast<size_t>(r);
      continue;
    }
    if (r == 0)
      return err::PeerDisconnected(fmt::format("peer closed the connection during {}", what));
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return err::PeerDisconnected(fmt::format("{} failed: {}", what, errno_text(errno)));
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return err::Timeout(fmt::format("{} timed out", what));
    pollfd p{fd, events, 0};
    ::poll(&p, 1, static_cast<int>(left.count()));
  }
  return Status::Ok();
}
}  // namespace

Status send_all(int fd, const void* data, size_t n, std::chrono::milliseconds timeout) {
  const auto* p = static_cast<const uint8_t*>(data);
  return blocking_io(
      fd, n, timeout, POLLOUT,
      [&](size_t done) { return ::send(fd, p + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT); },
      "send");
}

Status recv_all(int fd, void* data, size_t n, std::chrono::milliseconds timeout) {
  auto* p = static_cast<uint8_t*>(data);
  return blocking_io(
      fd, n, timeout, POLLIN,
      [&](size_t done) { return ::recv(fd, p + done, n - done, MSG_DONTWAIT); }, "receive");
}

void tune_stream_socket(int fd, std::chrono::milliseconds user_timeout, int sndbuf, int rcvbuf) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  int idle = 1, interval = 1, count = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  auto ut = static_cast<unsigned>(user_timeout.count());
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ut, sizeof ut);
  if (sndbuf > 0) setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
  if (rcvbuf > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
}

Status set_nonblocking(int fd, bool on) {
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, on ? flags | O_NONBLOCK : flags & ~O_NONBLOCK) < 0) {
    return err::Internal("fcntl(O_NONBLOCK): " + errno_text(errno));
  }
  return Status::Ok();
}

}  // namespace ferry::tcp
