#include "core/random_bytes.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "fmt/format.h"

namespace ferry {

Status random_bytes(void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  size_t left = n;
  while (left > 0) {
    // One call returns at most 32 MiB - 1 bytes, and a signal may cut a
    // request over 256 bytes short: loop until all are there.
    const ssize_t got = ::getrandom(p, left, 0);
    if (got < 0) {
      const int e = errno;
      if (e == EINTR) continue;
      return err::Internal(fmt::format("getrandom ({} of {} bytes left): {} (errno {})", left, n,
                                       std::strerror(e), e));
    }
    if (got == 0) {
      return err::Internal(fmt::format("getrandom returned no bytes ({} of {} left)", left, n));
    }
    p += got;
    left -= static_cast<size_t>(got);
  }
  return Status::Ok();
}

Result<uint64_t> random_nonzero_u64() {
  uint64_t v = 0;
  while (v == 0) {
    if (Status s = random_bytes(&v, sizeof v); !s.ok()) return s;
  }
  return v;
}

}  // namespace ferry
