// How a host-posted put splits its bytes over blocks: each block a contiguous
// share of whole 16-byte vectors (so the shares keep the buffers' alignment),
// the last one shorter. Shared by the put kernel and its unit test.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define FERRY_HOST_DEVICE __host__ __device__
#else
#define FERRY_HOST_DEVICE
#endif

namespace ferry::symmetric {

// Bytes per block: ceil(bytes / blocks) rounded up to a multiple of 16.
FERRY_HOST_DEVICE inline uint64_t put_share_bytes(uint64_t bytes, uint64_t blocks) {
  const uint64_t per = (bytes + blocks - 1) / blocks;
  return (per + 15) / 16 * 16;
}

// Block b's range [*first, *first + *n); *n is 0 for blocks past the end.
FERRY_HOST_DEVICE inline void put_share(uint64_t bytes, uint64_t blocks, uint64_t b,
                                        uint64_t* first, uint64_t* n) {
  const uint64_t per = put_share_bytes(bytes, blocks);
  *first = per * b;
  *n = *first >= bytes ? 0 : (bytes - *first < per ? bytes - *first : per);
}

}  // namespace ferry::symmetric

#undef FERRY_HOST_DEVICE
