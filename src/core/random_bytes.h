// Random bytes from the kernel's CSPRNG (getrandom(2)): region secrets, engine
// ids, connection nonces. The only source of randomness the engine uses.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/status.h"

namespace ferry {

// Fills [out, out + n) with bytes from getrandom(2) (the urandom source; it
// blocks only early in boot, until the kernel's pool is first seeded).
// Interrupted and short reads are retried; any other failure is an Internal
// status naming the errno, and then `out` holds nothing usable.
Status random_bytes(void* out, size_t n);

// A random u64 other than 0 (ids and probe values where 0 means "none").
Result<uint64_t> random_nonzero_u64();

}  // namespace ferry
