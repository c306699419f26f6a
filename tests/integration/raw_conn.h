// A plain TCP client for tests that speak Ferry's tcp wire format
// (src/transport/tcp/tcp_wire.h) by hand: malformed frames, garbage, handshakes
// left unfinished.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>

#include "ferry/types.h"
#include "transport/tcp/tcp_wire.h"

namespace ferry::itest {

using Clock = std::chrono::steady_clock;

inline bool ParseHostPort(const std::string& hp, sockaddr_in* sa) {
  const auto colon = hp.rfind(':');
  if (colon == std::string::npos) return false;
  *sa = {};
  sa->sin_family = AF_INET;
  sa->sin_port = htons(static_cast<uint16_t>(std::stoi(hp.substr(colon + 1))));
  return inet_pton(AF_INET, hp.substr(0, colon).c_str(), &sa->sin_addr) == 1;
}

class RawConn {
 public:
  explicit RawConn(const std::string& host_port) {
    sockaddr_in sa;
    if (!ParseHostPort(host_port, &sa)) return;
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
    int one = 1;
    if (fd_ >= 0) setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  ~RawConn() { Close(); }
  bool ok() const { return fd_ >= 0; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  bool Send(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    while (n > 0) {
      const ssize_t r = ::send(fd_, b, n, MSG_NOSIGNAL);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      b += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  bool Send(const Bytes& b) { return Send(b.data(), b.size()); }

  bool RecvExact(void* p, size_t n, std::chrono::milliseconds timeout) {
    auto* b = static_cast<uint8_t*>(p);
    const auto deadline = Clock::now() + timeout;
    while (n > 0) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      pollfd pfd{fd_, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) return false;
      const ssize_t r = ::recv(fd_, b, n, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      b += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }

  // True once the engine has closed the connection (EOF or reset), draining
  // whatever it sent before; false if it is still open after `timeout`.
  bool ClosedByPeer(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    char buf[4096];
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      pollfd pfd{fd_, POLLIN, 0};
      if (left.count() <= 0) return false;
      const int pr = ::poll(&pfd, 1, static_cast<int>(left.count()));
      if (pr < 0 && errno == EINTR) continue;
      if (pr <= 0) return false;
      const ssize_t r = ::recv(fd_, buf, sizeof buf, 0);
      if (r == 0) return true;
      if (r < 0 && errno != EINTR && errno != EAGAIN) return true;  // ECONNRESET
    }
  }

 private:
  int fd_ = -1;
};

inline tcp::Hello MakeHello(uint64_t engine_id) {
  tcp::Hello h{};
  h.magic = tcp::kHelloMagic;
  h.protocol_version = tcp::kProtocolVersion;
  h.stream_index = 0;
  h.engine_id = engine_id;
  h.group_nonce = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  h.stream_count = 1;
  return h;
}

}  // namespace ferry::itest
