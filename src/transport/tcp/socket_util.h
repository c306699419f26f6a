// Small POSIX socket helpers for the tcp transport. Every failure names the
// address and carries strerror(errno).
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"

namespace ferry::tcp {

struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  std::string to_string() const;  // "1.2.3.4:5" or "[::1]:5"
  bool is_wildcard() const;
  uint16_t port() const;
};

// Splits "host:port" / "[v6]:port" and resolves the host (numeric or name).
Result<std::vector<SocketAddress>> resolve(std::string_view host_port);
// Socket bound and listening, non-blocking, SO_REUSEADDR.
Result<int> listen_on(const SocketAddress& address, SocketAddress* bound);
// Connect bounded by `timeout`; returns a connected non-blocking socket.
Result<int> connect_to(const SocketAddress& address, std::chrono::milliseconds timeout);
// Interface addresses for advertising a wildcard listener (non-loopback first).
std::vector<SocketAddress> interface_addresses(int family, uint16_t port);

// Sends/receives exactly `n` bytes (any socket mode), bounded by `timeout`.
Status send_all(int fd, const void* data, size_t n, std::chrono::milliseconds timeout);
Status recv_all(int fd, void* data, size_t n, std::chrono::milliseconds timeout);

// TCP_NODELAY, keepalive and TCP_USER_TIMEOUT so a dead peer is noticed.
void tune_stream_socket(int fd, std::chrono::milliseconds user_timeout, int sndbuf, int rcvbuf);
Status set_nonblocking(int fd, bool on);
std::string errno_text(int err);

}  // namespace ferry::tcp
