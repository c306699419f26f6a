// Cross-memory attach (process_vm_readv / process_vm_writev): the probe at
// connect, the copy loops, errno → Status, and the Yama ptrace policy.
//
// The kernel allows these calls only where ptrace would be allowed (same
// user, no Yama restriction or an explicit PR_SET_PTRACER, same user
// namespace), so permission is probed with a real read at connect rather than
// guessed from uids.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "ferry/status.h"
#include "transport/common/unix_socket.h"

namespace ferry::shm {

// "Operation not permitted (EPERM)", in every shm message.
using unix_socket::errno_text;

// The Status for a failed process_vm_* call on `pid`: EPERM → PermissionDenied
// (with the ptrace policy that likely refused it), ENOSYS → NotSupported,
// ESRCH → PeerDisconnected, anything else → Internal; always with the errno
// text. `call` names the syscall.
Status cma_error(int err, pid_t pid, std::string_view call);

// Reads kProbeBytes at `address` of `pid` and compares them with `expected`:
// proves that this process may attach to that one, and that the peer is who
// it says it is (it alone knows the value).
Status probe(pid_t pid, uint64_t address, uint64_t expected);

// One piece of a copy: `length` bytes at `local` in this process and at
// `remote` in the other.
struct CopyPiece {
  uint8_t* local;
  uint64_t remote;
  uint64_t length;
};

enum class Direction { kPull, kPush };  // pull: readv (remote → local); push: writev

// Moves every byte of `pieces`, IOV_MAX iovecs per call, resuming after a
// partial result. On failure returns the mapped error and sets *failed to the
// index of the piece where the copy stopped and *moved to the bytes placed.
// `wanted`, if given, is asked right before each call: false stops the copy
// with Cancelled (the other process gave up on it).
Status cma_copy(pid_t pid, Direction direction, std::span<const CopyPiece> pieces, size_t* failed,
                uint64_t* moved, const std::function<bool()>& wanted = {});

// A pidfd for `pid` (-1 where the kernel has none): taken right after the
// probe proved who runs under that pid, it tells later whether that very
// process has exited, so a copy never lands in a process that reused the pid.
int open_pidfd(pid_t pid);
bool process_exited(int pidfd);

// Checks that process_vm_readv works at all (on our own pid): NotSupported
// with the reason when the kernel lacks it or a seccomp policy forbids it.
Status check_self();

// /proc/sys/kernel/yama/ptrace_scope, or -1 without Yama.
int yama_ptrace_scope();
// Under Yama scope 1 only ancestors may attach; PR_SET_PTRACER_ANY lets
// same-user sibling processes (two ranks under one launcher) attach to us.
Status allow_any_ptracer();

}  // namespace ferry::shm
