// CRC-32 of IEEE 802.3 (reflected, polynomial 0xEDB88320, initial value and
// final xor 0xFFFFFFFF): the checksum of descriptors (core/descriptor.cc) and
// engine metadata (core/metadata.cc), and the same function as zlib's crc32()
// and Python's zlib.crc32 (python/ferry/_metadata.py checks it there).
#pragma once

#include <cstdint>
#include <span>

namespace ferry {

// CRC-32 of `data` continuing from `crc`, the CRC-32 of the bytes before it
// (0 to start), as zlib's crc32(crc, buf, len): crc32(b, crc32(a)) equals
// crc32 of a followed by b.
uint32_t crc32(std::span<const uint8_t> data, uint32_t crc = 0);

}  // namespace ferry
