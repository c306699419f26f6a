#include "core/metadata.h"

#include "core/byte_codec.h"
#include "core/crc32.h"
#include "core/version.h"
#include "fmt/format.h"

namespace ferry {
namespace {
constexpr uint32_t kMetadataMagic = 0x4d595246;  // "FRYM"
constexpr size_t kMaxTransports = 16;
constexpr size_t kMaxBlob = 4096;
}  // namespace

Bytes EngineMetadata::encode() const {
  Bytes out;
  ByteWriter w(out);
  w.u32(kMetadataMagic);
  w.u16(kFormatVersion);
  w.u16(protocol_version);
  w.u64(engine_id);
  w.str16(hostname);
  w.str16(host_id);
  w.u16(static_cast<uint16_t>(transports.size()));
  for (const auto& t : transports) {
    w.str16(t.transport);
    w.u32(static_cast<uint32_t>(t.blob.size()));
    w.bytes(t.blob.data(), t.blob.size());
  }
  w.u32(crc32(out));
  return out;
}

Result<EngineMetadata> EngineMetadata::decode(ByteView bytes) {
  if (bytes.size() < 4 + 2 + 2 + 8 + 2 + 2 + 2 + 4) {
    return err::InvalidArgument(
        fmt::format("engine metadata too short: {} bytes (truncated?)", bytes.size()));
  }
  if (bytes.size() > kMaxEncodedSize) {
    return err::InvalidArgument(fmt::format("engine metadata too long: {} bytes, limit {}",
                                            bytes.size(), kMaxEncodedSize));
  }
  ByteReader r(bytes);
  const uint32_t magic = r.u32();
  if (magic != kMetadataMagic) {
    return err::InvalidArgument(
        fmt::format("not Ferry engine metadata: magic {:#010x}, expected {:#010x}", magic,
                    kMetadataMagic));
  }
  const uint16_t format = r.u16();
  if (format != kFormatVersion) {
    return err::InvalidArgument(fmt::format(
        "engine metadata format {} is not supported (this build reads format {})", format,
        kFormatVersion));
  }
  const size_t body = bytes.size() - 4;
  uint32_t stored_crc;
  std::memcpy(&stored_crc, bytes.data() + body, 4);
  const uint32_t crc = crc32(bytes.first(body));
  if (crc != stored_crc) {
    return err::InvalidArgument(fmt::format(
        "engine metadata checksum mismatch: stored {:#010x}, computed {:#010x}", stored_crc, crc));
  }
  ByteReader body_reader(bytes.first(body));
  body_reader.u32();
  body_reader.u16();
  EngineMetadata m;
  m.protocol_version = body_reader.u16();
  m.engine_id = body_reader.u64();
  m.hostname = body_reader.str16();
  m.host_id = body_reader.str16();
  const uint16_t count = body_reader.u16();
  if (!body_reader.ok()) return err::InvalidArgument("engine metadata truncated in its header");
  if (count > kMaxTransports) {
    return err::InvalidArgument(
        fmt::format("engine metadata lists {} transports, limit {}", count, kMaxTransports));
  }
  for (uint16_t i = 0; i < count; ++i) {
    TransportAddress t;
    t.transport = body_reader.str16();
    const uint32_t len = body_reader.u32();
    if (!body_reader.ok() || len > kMaxBlob || len > body_reader.remaining()) {
      return err::InvalidArgument(
          fmt::format("engine metadata transport entry {} is truncated or too long", i));
    }
    auto blob = body_reader.bytes(len);
    t.blob.assign(blob.begin(), blob.end());
    m.transports.push_back(std::move(t));
  }
  if (!body_reader.ok()) return err::InvalidArgument("engine metadata truncated");
  if (body_reader.remaining() != 0) {
    return err::InvalidArgument(fmt::format("engine metadata has {} unexpected trailing bytes",
                                            body_reader.remaining()));
  }
  if (m.engine_id == 0) return err::InvalidArgument("engine metadata has engine id 0");
  return m;
}

const TransportAddress* EngineMetadata::find(std::string_view transport) const {
  for (const auto& t : transports) {
    if (t.transport == transport) return &t;
  }
  return nullptr;
}

Result<EngineMetadata> decode_peer_metadata(ByteView bytes) {
  auto m = EngineMetadata::decode(bytes);
  if (!m.ok()) return m.status();
  if (m->protocol_version != kProtocolVersion) {
    return err::ProtocolError(fmt::format(
        "protocol version mismatch: engine {:016x} on {} speaks {}, this engine speaks {}",
        m->engine_id, m->hostname, m->protocol_version, kProtocolVersion));
  }
  return m;
}

}  // namespace ferry
