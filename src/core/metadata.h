// Engine metadata: the bytes a peer needs to connect to us.
//
// Layout (little endian): "FRYM" magic, u16 format version, u16 protocol
// version, u64 engine id, str16 hostname, str16 host id, u16 transport count, then per
// transport str16 name + u32 length + blob, then a u32 CRC-32 (core/crc32.h, zlib's
// crc32) of all before it.
#pragma once

#include <string>
#include <vector>

#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry {

struct TransportAddress {
  std::string transport;  // "tcp"
  Bytes blob;             // transport-specific address bytes
};

struct EngineMetadata {
  static constexpr uint16_t kFormatVersion = 2;
  static constexpr size_t kMaxEncodedSize = 64 * 1024;

  uint64_t engine_id = 0;
  uint16_t protocol_version = 0;
  std::string hostname;
  // Identity of the machine's kernel (its boot id unless the engine.host_id
  // option says otherwise): engines with equal host ids may use same-host
  // transports. Never derived from addresses.
  std::string host_id;
  std::vector<TransportAddress> transports;

  Bytes encode() const;
  static Result<EngineMetadata> decode(ByteView bytes);
  const TransportAddress* find(std::string_view transport) const;
};

// Peer metadata as every connect path takes it -- Engine::connect(metadata)
// and the metadata a tcp handshake carries: decoded (EngineMetadata::decode's
// checks) and of this build's protocol version (ProtocolError naming both).
Result<EngineMetadata> decode_peer_metadata(ByteView bytes);

}  // namespace ferry
