#include "transport/shm/cma.h"

#include <poll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>

#include "fmt/format.h"
#include "transport/shm/shm_wire.h"

namespace ferry::shm {
namespace {

constexpr size_t kIovBatch = 1024;  // IOV_MAX

std::string ptrace_hint() {
  const int scope = yama_ptrace_scope();
  if (scope < 0) {
    return "processes of different users, a different user namespace, or a seccomp policy "
           "(no Yama LSM here)";
  }
  return fmt::format(
      "ptrace policy /proc/sys/kernel/yama/ptrace_scope={} or a different user namespace", scope);
}

}  // namespace

Status cma_error(int err, pid_t pid, std::string_view call) {
  switch (err) {
    case EPERM:
    case EACCES:
      return err::PermissionDenied(
          fmt::format("shm: cross-memory attach to pid {} refused: {}: {}; {}", pid, call,
                      errno_text(err), ptrace_hint()));
    case ENOSYS:
      return err::NotSupported(fmt::format(
          "shm: {} is not available (kernel without CONFIG_CROSS_MEMORY_ATTACH or a seccomp "
          "filter): {}",
          call, errno_text(err)));
    case ESRCH:
      return err::PeerDisconnected(
          fmt::format("shm: process {} is gone: {}: {}", pid, call, errno_text(err)));
    default:
      return err::Internal(fmt::format("shm: cross-memory attach to pid {} failed: {}: {}", pid,
                                       call, errno_text(err)));
  }
}

Status probe(pid_t pid, uint64_t address, uint64_t expected) {
  if (pid <= 0) {
    return err::NotSupported(
        "shm: the peer's pid is not visible from this process (another pid namespace): "
        "cross-memory attach needs it");
  }
  uint64_t got = 0;
  iovec local{&got, sizeof got};
  iovec remote{reinterpret_cast<void*>(address), sizeof got};
  ssize_t n;
  do {
    n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return cma_error(errno, pid, "process_vm_readv");
  if (n != static_cast<ssize_t>(sizeof got)) {
    return err::Internal(fmt::format("shm: probe of pid {} at {:#x} read {} of {} bytes", pid,
                                     address, n, sizeof got));
  }
  if (got != expected) {
    return err::PermissionDenied(fmt::format(
        "shm: probe of pid {} at {:#x} read {:#018x}, expected {:#018x}: the process behind the "
        "socket is not the engine that sent the handshake (pid namespace mismatch?)",
        pid, address, got, expected));
  }
  return Status::Ok();
}

Status cma_copy(pid_t pid, Direction direction, std::span<const CopyPiece> pieces, size_t* failed,
                uint64_t* moved, const std::function<bool()>& wanted) {
  const char* call = direction == Direction::kPull ? "process_vm_readv" : "process_vm_writev";
  iovec local[kIovBatch];
  iovec remote[kIovBatch];
  size_t index = 0;     // first piece not fully moved
  uint64_t offset = 0;  // bytes of pieces[index] already moved
  uint64_t total = 0;
  *failed = 0;
  *moved = 0;
  while (index < pieces.size()) {
    // Local and remote iovecs pair up piece by piece; the kernel treats each
    // side as one byte stream, so a partial result is resumed by byte count.
    size_t n = 0;
    for (size_t i = index; i < pieces.size() && n < kIovBatch; ++i, ++n) {
      const uint64_t skip = i == index ? offset : 0;
      const uint64_t len = pieces[i].length - skip;
      local[n] = {pieces[i].local + skip, len};
      remote[n] = {reinterpret_cast<void*>(pieces[i].remote + skip), len};
    }
    if (wanted && !wanted()) {
      *failed = index;
      *moved = total;
      return err::Cancelled(fmt::format("{} of pid {} stopped after {} bytes: not wanted any more",
                                        call, pid, total));
    }
    const ssize_t r = direction == Direction::kPull
                          ? process_vm_readv(pid, local, n, remote, n, 0)
                          : process_vm_writev(pid, local, n, remote, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      // 0 bytes moved: the first remote iovec is not mapped (the kernel
      // reports EFAULT only when nothing at all could be moved).
      const int e = r < 0 ? errno : EFAULT;
      *failed = index;
      *moved = total;
      Status s = cma_error(e, pid, call);
      return Status(
          s.code(),
          fmt::format("{} (after {} bytes, at piece {}: {:#x}+{} of pid {}, {} bytes)", s.message(),
                      total, index, pieces[index].remote, offset, pid, pieces[index].length));
    }
    // Advance the cursor by what was moved (at most 2 GiB per call, or up to
    // the first unmapped remote page).
    uint64_t left = static_cast<uint64_t>(r);
    total += left;
    while (left > 0) {
      const uint64_t rest = pieces[index].length - offset;
      if (left < rest) {
        offset += left;
        left = 0;
      } else {
        left -= rest;
        ++index;
        offset = 0;
      }
    }
  }
  *moved = total;
  return Status::Ok();
}

int open_pidfd(pid_t pid) {
  const long fd = syscall(SYS_pidfd_open, pid, 0);
  return fd < 0 ? -1 : static_cast<int>(fd);
}

bool process_exited(int pidfd) {
  if (pidfd < 0) return false;
  pollfd p{pidfd, POLLIN, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & POLLIN) != 0;
}

Status check_self() {
  const uint64_t value = 0x6665727279u;  // "ferry"
  uint64_t got = 0;
  iovec local{&got, sizeof got};
  iovec remote{const_cast<uint64_t*>(&value), sizeof value};
  if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) != static_cast<ssize_t>(sizeof got)) {
    const int e = errno;
    if (e == ENOSYS) {
      return err::NotSupported(
          fmt::format("shm: process_vm_readv is not available: {} (kernel without "
                      "CONFIG_CROSS_MEMORY_ATTACH, or a seccomp filter)",
                      errno_text(e)));
    }
    return Status(cma_error(e, getpid(), "process_vm_readv").code(),
                  fmt::format("shm: process_vm_readv on this process fails: {}", errno_text(e)));
  }
  if (got != value) return err::Internal("shm: process_vm_readv on this process read wrong bytes");
  return Status::Ok();
}

int yama_ptrace_scope() {
  std::ifstream in("/proc/sys/kernel/yama/ptrace_scope");
  int scope = -1;
  if (!(in >> scope)) return -1;
  return scope;
}

Status allow_any_ptracer() {
  if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0) {
    return err::Internal(fmt::format("shm: prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) failed: {}",
                                     errno_text(errno)));
  }
  return Status::Ok();
}

}  // namespace ferry::shm
