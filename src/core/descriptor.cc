// RemoteDescriptor's fixed 64-byte encoding:
//   0 u16 magic 'FD' | 2 u8 version | 3 u8 access | 4 u8 kind | 5..7 see below
//   8 engine_id | 16 region_id | 24 address | 32 region_offset | 40 length
//   48 key | 56 u32 see below | 60 u32 crc32 of bytes 0..59
// Version 1 (host memory, and every descriptor of older builds):
//   5..7 zero | 56 i32 device (the owner's CUDA ordinal, -1 for host memory)
// Version 2 (GPU memory whose GPU is known): the GPU named by what it is,
//   since the owner's ordinal means nothing under another CUDA_VISIBLE_DEVICES:
//   5 zero | 6 u16 device (the owner's ordinal) | 56 u32 the GPU's PCI bus id,
//   packed (ferry/gpu.h pack_pci_bus_id)
// Host-memory descriptors stay version 1, readable by older builds.
#include <string>

#include "core/byte_codec.h"
#include "core/crc32.h"
#include "ferry/types.h"
#include "fmt/format.h"

namespace ferry {
namespace {
constexpr uint16_t kDescriptorMagic = 0x4446;  // "FD"
constexpr uint8_t kDescriptorVersion = 1;
constexpr uint8_t kDescriptorVersionGpuNamed = 2;
}  // namespace

std::string_view memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return "host";
    case MemoryKind::kCuda: return "cuda";
  }
  return "unknown";
}

std::string access_name(uint8_t access) {
  switch (access) {
    case kAccessRead: return "read";
    case kAccessWrite: return "write";
    case kAccessReadWrite: return "read-write";
    default: return fmt::format("invalid({})", access);
  }
}

Bytes RemoteDescriptor::to_bytes() const {
  Bytes out;
  out.reserve(kEncodedSize);
  ByteWriter w(out);
  const bool named = kind == MemoryKind::kCuda && gpu_pci != 0 && device >= 0 && device <= 0xffff;
  w.u16(kDescriptorMagic);
  w.u8(named ? kDescriptorVersionGpuNamed : kDescriptorVersion);
  w.u8(access);
  w.u8(static_cast<uint8_t>(kind));
  w.u8(0);
  w.u16(named ? static_cast<uint16_t>(device) : 0);
  w.u64(engine_id);
  w.u64(region_id);
  w.u64(address);
  w.u64(region_offset);
  w.u64(length);
  w.u64(key);
  w.u32(named ? gpu_pci : static_cast<uint32_t>(device));
  w.u32(crc32(out));
  return out;
}

Result<RemoteDescriptor> RemoteDescriptor::from_bytes(ByteView bytes) {
  if (bytes.size() != kEncodedSize) {
    return err::InvalidArgument(
        fmt::format("remote descriptor must be {} bytes, got {}", kEncodedSize, bytes.size()));
  }
  ByteReader r(bytes);
  const uint16_t magic = r.u16();
  const uint8_t version = r.u8();
  RemoteDescriptor d;
  d.access = r.u8();
  const uint8_t kind = r.u8();
  const uint8_t pad8 = r.u8();
  const uint16_t pad16 = r.u16();
  d.engine_id = r.u64();
  d.region_id = r.u64();
  d.address = r.u64();
  d.region_offset = r.u64();
  d.length = r.u64();
  d.key = r.u64();
  const uint32_t word56 = r.u32();
  const uint32_t crc = r.u32();
  if (magic != kDescriptorMagic) {
    return err::InvalidArgument(fmt::format(
        "not a remote descriptor: magic {:#06x}, expected {:#06x}", magic, kDescriptorMagic));
  }
  if (version != kDescriptorVersion && version != kDescriptorVersionGpuNamed) {
    return err::InvalidArgument(fmt::format(
        "remote descriptor version {} is not supported (this build reads versions {} and {})",
        version, kDescriptorVersion, kDescriptorVersionGpuNamed));
  }
  const uint32_t expected_crc = crc32(bytes.first(60));
  if (crc != expected_crc) {
    return err::InvalidArgument(fmt::format(
        "remote descriptor checksum mismatch: stored {:#010x}, computed {:#010x} (corrupted "
        "in transit?)",
        crc, expected_crc));
  }
  if (pad8 != 0 || (version == kDescriptorVersion && pad16 != 0)) {
    return err::InvalidArgument("remote descriptor has non-zero reserved bytes");
  }
  if (version == kDescriptorVersionGpuNamed) {
    if (kind != static_cast<uint8_t>(MemoryKind::kCuda) || word56 == 0) {
      return err::InvalidArgument(fmt::format(
          "remote descriptor version {} names a GPU, but its memory kind is {} and its PCI bus "
          "id {:#x}",
          version, kind, word56));
    }
    d.device = pad16;
    d.gpu_pci = word56;
  } else {
    d.device = static_cast<int32_t>(word56);
  }
  if (d.access == 0 || d.access > kAccessReadWrite) {
    return err::InvalidArgument(fmt::format("remote descriptor has invalid access {}", d.access));
  }
  if (kind > static_cast<uint8_t>(MemoryKind::kCuda)) {
    return err::InvalidArgument(fmt::format("remote descriptor has unknown memory kind {}", kind));
  }
  d.kind = static_cast<MemoryKind>(kind);
  if (d.region_offset + d.length < d.region_offset) {
    return err::InvalidArgument("remote descriptor range overflows 64 bits");
  }
  return d;
}

}  // namespace ferry
