// Value types of the public API: ids, iovs, descriptors, notifications.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry {

using Bytes = std::vector<uint8_t>;
using ByteView = std::span<const uint8_t>;

// Ids are never reused within one engine's life, so a stale id is reported
// as unknown rather than aliasing a newer object.
using RegionId = uint64_t;
using PeerId = uint64_t;      // the remote engine's id (random, from its metadata)
using TransferId = uint64_t;  // 0 is never a valid transfer

enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };
std::string_view memory_kind_name(MemoryKind kind);

// Access a remote peer is granted on an advertised range.
enum Access : uint8_t {
  kAccessRead = 1,   // the peer may READ from the range
  kAccessWrite = 2,  // the peer may WRITE into the range
  kAccessReadWrite = 3,
};
std::string access_name(uint8_t access);

// A registered local region, as returned by Engine::register_memory.
struct MemoryRegion {
  RegionId id = 0;
  void* address = nullptr;
  uint64_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // CUDA device ordinal, -1 for host memory
};

// Serializable proof that a peer may access [region_offset, region_offset+length)
// of one registered region. Produced by Engine::advertise on the target, sent to
// the initiator out of band, passed back in RemoteIov. Encodes to exactly
// kEncodedSize bytes.
struct RemoteDescriptor {
  static constexpr size_t kEncodedSize = 64;

  uint64_t engine_id = 0;      // owner engine
  RegionId region_id = 0;      // region on the owner
  uint64_t address = 0;        // owner's virtual address of the advertised start
  uint64_t region_offset = 0;  // advertised start, relative to the region base
  uint64_t length = 0;         // advertised length
  uint64_t key = 0;            // PRF(region secret, range, access): checked by the owner
  uint8_t access = kAccessReadWrite;
  MemoryKind kind = MemoryKind::kHost;
  // The owner's CUDA ordinal of the GPU. Its own numbering: a process with
  // another CUDA_VISIBLE_DEVICES names the same GPU differently, so the
  // GPU is identified by gpu_pci (gpu_ordinal(pci_bus_id_text(gpu_pci))).
  int32_t device = -1;
  // The GPU's PCI bus id, packed (ferry/gpu.h pack_pci_bus_id); 0 for host
  // memory and in descriptors of format 1 (older builds).
  uint32_t gpu_pci = 0;

  Bytes to_bytes() const;
  // Rejects wrong size, bad magic, unknown version, bad checksum, bad fields.
  static Result<RemoteDescriptor> from_bytes(ByteView bytes);
};

// Local side of one iov: a pointer inside a registered region.
struct LocalIov {
  void* address = nullptr;
  uint64_t length = 0;
};

// Remote side of one iov: `offset` is relative to the descriptor's start.
// The descriptor must stay alive for the duration of the posting call only.
struct RemoteIov {
  const RemoteDescriptor* descriptor = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct Notification {
  PeerId peer = 0;  // the sending engine
  Bytes payload;
};

}  // namespace ferry
