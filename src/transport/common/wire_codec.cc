#include "transport/common/wire_codec.h"

#include "fmt/format.h"

namespace ferry::wire_codec {

std::string_view clipped(const Codec& codec, const std::string& message) {
  return std::string_view(message).substr(0, codec.max_message_bytes);
}

Result<StatusCode> status_code(const Codec& codec, uint32_t code, std::string_view what) {
  if (code > static_cast<uint32_t>(StatusCode::kInternal)) {
    return err::ProtocolError(
        fmt::format("{}{} with unknown status code {}", codec.error_prefix, what, code));
  }
  return static_cast<StatusCode>(code);
}

void put_status_head(const Codec& codec, ByteWriter& w, const Status& s) {
  w.u16(static_cast<uint16_t>(s.code()));
  w.u16(0);
  w.u32(static_cast<uint32_t>(clipped(codec, s.message()).size()));
}

void put_message(const Codec& codec, ByteWriter& w, const Status& s) {
  const std::string_view m = clipped(codec, s.message());
  w.bytes(m.data(), m.size());
}

Status take_status_head(const Codec& codec, ByteReader& r, std::string_view what, uint16_t* code,
                        uint32_t* length) {
  *code = r.u16();
  const uint16_t reserved = r.u16();
  *length = r.u32();
  if (r.ok() && reserved != 0) {
    return err::ProtocolError(
        fmt::format("{}{} has reserved bytes set ({:#06x})", codec.error_prefix, what, reserved));
  }
  return Status::Ok();
}

Status take_status(const Codec& codec, ByteReader& r, uint16_t code, uint32_t length,
                   std::string_view what, Status* out) {
  auto c = status_code(codec, code, what);
  if (!c.ok()) return c.status();
  if (length > codec.max_message_bytes || length != r.remaining()) {
    return err::ProtocolError(fmt::format("{}{}: message of {} bytes in {} bytes left (limit {})",
                                          codec.error_prefix, what, length, r.remaining(),
                                          codec.max_message_bytes));
  }
  auto m = r.bytes(length);
  *out = Status(*c, std::string(reinterpret_cast<const char*>(m.data()), m.size()));
  return Status::Ok();
}

Status expect_end(const Codec& codec, const ByteReader& r, std::string_view what) {
  if (!r.ok()) return err::ProtocolError(fmt::format("{}truncated {}", codec.error_prefix, what));
  if (r.remaining() != 0) {
    return err::ProtocolError(fmt::format("{}{} has {} unexpected trailing bytes",
                                          codec.error_prefix, what, r.remaining()));
  }
  return Status::Ok();
}

Bytes frame(const FrameFormat& format, uint8_t op, const Bytes& body, uint8_t flags) {
  Bytes out;
  out.reserve(kFrameHeaderBytes + body.size());
  ByteWriter w(out);
  w.u32(format.magic);
  w.u16(format.version);
  w.u8(op);
  w.u8(flags);
  w.u32(static_cast<uint32_t>(body.size()));
  w.u32(0);
  w.bytes(body.data(), body.size());
  return out;
}

Result<FrameHeader> decode_header(const FrameFormat& format, ByteView bytes) {
  const std::string_view prefix = format.codec.error_prefix;
  if (bytes.size() < kFrameHeaderBytes) {
    return err::ProtocolError(fmt::format("{}truncated frame header ({} of {} bytes)", prefix,
                                          bytes.size(), kFrameHeaderBytes));
  }
  ByteReader r(bytes.first(kFrameHeaderBytes));
  const uint32_t magic = r.u32();
  FrameHeader h;
  h.version = r.u16();
  h.op = r.u8();
  h.flags = r.u8();
  h.body_bytes = r.u32();
  const uint32_t reserved = r.u32();
  if (magic != format.magic) {
    return err::ProtocolError(
        fmt::format("{}bad frame magic {:#010x}, expected {:#010x}", prefix, magic, format.magic));
  }
  if (h.op < format.first_op || h.op > format.last_op) {
    return err::ProtocolError(fmt::format("{}unknown opcode {}", prefix, h.op));
  }
  const OpRules rules = format.rules(h.op);
  if (!rules.handshake && h.version != format.version) {
    return err::ProtocolError(fmt::format("{}{} frame of wire version {}, this engine speaks {}",
                                          prefix, rules.name, h.version, format.version));
  }
  if ((h.flags & ~rules.allowed_flags) != 0 || reserved != 0) {
    return err::ProtocolError(fmt::format(
        "{}{} frame with flags {:#04x} (allowed {:#04x}), reserved {:#010x} (must be 0)", prefix,
        rules.name, h.flags, rules.allowed_flags, reserved));
  }
  if (h.body_bytes > rules.max_body_bytes) {
    return err::ProtocolError(fmt::format("{}{} frame announces {} body bytes (limit {})", prefix,
                                          rules.name, h.body_bytes, rules.max_body_bytes));
  }
  return h;
}

void put_remote_range(ByteWriter& w, const RemoteAccessRequest& q) {
  w.u64(q.region_id);
  w.u64(q.adv_offset);
  w.u64(q.adv_length);
  w.u64(q.key);
  w.u64(q.offset);
  w.u64(q.length);
}

void take_remote_range(ByteReader& r, RemoteAccessRequest* q) {
  q->region_id = r.u64();
  q->adv_offset = r.u64();
  q->adv_length = r.u64();
  q->key = r.u64();
  q->offset = r.u64();
  q->length = r.u64();
}

void put_access_tail(ByteWriter& w, uint8_t access) {
  w.u8(access);
  for (int i = 0; i < 7; ++i) w.u8(0);
}

bool take_access_tail(ByteReader& r, uint8_t* access) {
  *access = r.u8();
  uint8_t reserved = 0;
  for (int k = 0; k < 7; ++k) reserved |= r.u8();
  return reserved == 0;
}

}  // namespace ferry::wire_codec
