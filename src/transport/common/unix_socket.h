// Unix stream sockets for the same-host transports' control channels:
// pathname listeners (they work across network namespaces that share the
// filesystem), the peer's pid from SO_PEERCRED, and file descriptors passed
// with SCM_RIGHTS (cuMem export handles, memfds). Every failure names the
// socket path and carries strerror(errno).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <span>
#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry::unix_socket {

// The longest path sun_path holds (108 bytes with the terminating NUL).
constexpr size_t kMaxPath = 107;
// Most descriptors one sendmsg may carry (the kernel's SCM_MAX_FD is 253).
constexpr size_t kMaxFdsPerMessage = 250;

// A non-blocking listener bound to `path` (a leftover file there is removed
// first). NotSupported when the directory does not allow it.
Result<int> listen_at(const std::string& path, const char* who);
// A connected, blocking socket, bounded by `timeout`.
Result<int> connect_to(const std::string& path, std::chrono::milliseconds timeout, const char* who);
// The pid of the process at the other end (SO_PEERCRED).
Result<pid_t> peer_pid(int fd);
// Blocking send of the whole buffer, the descriptors (at most
// kMaxFdsPerMessage) riding with its first byte. The socket's send timeout
// (set_send_timeout) bounds it.
Status send_all(int fd, std::span<const uint8_t> bytes, std::span<const int> fds = {});
void set_send_timeout(int fd, std::chrono::milliseconds timeout);
// One non-blocking recvmsg into `buffer`; descriptors that came with the
// bytes are appended to *fds (the caller owns them). Returns the byte count,
// 0 at end of stream, or -1 with errno EAGAIN when nothing is there. An
// error, or descriptors the kernel had to drop (MSG_CTRUNC), is a Status.
Result<ssize_t> receive(int fd, std::span<uint8_t> buffer, std::vector<int>* fds);
// "Operation not permitted (EPERM)".
std::string errno_text(int err);

}  // namespace ferry::unix_socket
