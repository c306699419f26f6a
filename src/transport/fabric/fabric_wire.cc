#include "transport/fabric/fabric_wire.h"

#include "core/byte_codec.h"
#include "fmt/format.h"
#include "transport/common/wire_codec.h"

namespace ferry::fabric {
namespace {
constexpr wire_codec::Codec kCodec{"fabric: ", kMaxTextBytes};
}  // namespace

const char* msg_type_name(uint8_t type) {
  switch (static_cast<MsgType>(type)) {
    case MsgType::kHello:
      return "HELLO";
    case MsgType::kHelloAck:
      return "HELLO_ACK";
    case MsgType::kGrantReq:
      return "GRANT_REQ";
    case MsgType::kGrant:
      return "GRANT";
    case MsgType::kRevoke:
      return "REVOKE";
    case MsgType::kNotify:
      return "NOTIFY";
    case MsgType::kPing:
      return "PING";
    case MsgType::kPong:
      return "PONG";
    case MsgType::kBye:
      return "BYE";
    case MsgType::kRevokeAck:
      return "REVOKE_ACK";
  }
  return "?";
}

Bytes encode(MsgType type, uint64_t sender, uint64_t request, const Bytes& body) {
  Bytes out;
  out.reserve(kHeaderBytes + body.size());
  ByteWriter w(out);
  w.u32(kMagic);
  w.u8(kWireVersion);
  w.u8(static_cast<uint8_t>(type));
  w.u16(0);
  w.u64(sender);
  w.u64(request);
  w.u32(static_cast<uint32_t>(body.size()));
  w.u32(0);
  w.bytes(body.data(), body.size());
  return out;
}

Result<Header> decode_header(const uint8_t* data, size_t len) {
  if (len < kHeaderBytes) {
    return err::ProtocolError(fmt::format(
        "fabric: message of {} bytes is shorter than the {}-byte header", len, kHeaderBytes));
  }
  ByteReader r(ByteView(data, kHeaderBytes));
  const uint32_t magic = r.u32();
  const uint8_t version = r.u8();
  Header h;
  h.type = r.u8();
  const uint16_t pad = r.u16();
  h.sender = r.u64();
  h.request = r.u64();
  h.body_bytes = r.u32();
  const uint32_t pad2 = r.u32();
  if (magic != kMagic) {
    return err::ProtocolError(
        fmt::format("fabric: bad magic {:#010x} (expected {:#010x})", magic, kMagic));
  }
  if (version != kWireVersion) {
    return err::ProtocolError(
        fmt::format("fabric: wire version {} from engine {:016x}; this engine speaks {}", version,
                    h.sender, kWireVersion));
  }
  if (h.type < static_cast<uint8_t>(MsgType::kHello) ||
      h.type > static_cast<uint8_t>(MsgType::kRevokeAck)) {
    return err::ProtocolError(fmt::format("fabric: unknown message type {}", h.type));
  }
  if (pad != 0 || pad2 != 0) {
    return err::ProtocolError("fabric: reserved header fields are not zero");
  }
  if (h.body_bytes > kMaxBodyBytes || h.body_bytes != len - kHeaderBytes) {
    return err::ProtocolError(
        fmt::format("fabric: {} claims a {}-byte body, {} bytes arrived (at most {})",
                    msg_type_name(h.type), h.body_bytes, len - kHeaderBytes, kMaxBodyBytes));
  }
  return h;
}

Bytes encode_hello(const Hello& h) {
  Bytes out;
  ByteWriter w(out);
  w.u16(h.protocol);
  w.u64(h.expected);
  w.str16(h.provider);
  w.u16(static_cast<uint16_t>(h.address.size()));
  w.bytes(h.address.data(), h.address.size());
  w.u16(h.flags);
  return out;
}

Result<Hello> decode_hello(ByteView body) {
  ByteReader r(body);
  Hello h;
  h.protocol = r.u16();
  h.expected = r.u64();
  h.provider = r.str16();
  const uint16_t n = r.u16();
  if (r.ok() && (n == 0 || n > kMaxAddressBytes)) {
    return err::ProtocolError(
        fmt::format("fabric: HELLO address of {} bytes (1 to {})", n, kMaxAddressBytes));
  }
  auto a = r.bytes(n);
  h.address.assign(a.begin(), a.end());
  if (r.ok() && r.remaining() >= 2) h.flags = r.u16();
  if (Status s = wire_codec::expect_end(kCodec, r, "HELLO"); !s.ok()) return s;
  return h;
}

Bytes encode_status(const Status& s) {
  Bytes out;
  ByteWriter w(out);
  w.u8(static_cast<uint8_t>(s.code()));
  w.str16(wire_codec::clipped(kCodec, s.message()));
  return out;
}

Status decode_status(ByteView body, Status* out, size_t* used) {
  ByteReader r(body);
  const uint8_t code = r.u8();
  std::string m = r.str16();
  if (!r.ok()) return err::ProtocolError("fabric: truncated status");
  auto c = wire_codec::status_code(kCodec, code, "status");
  if (!c.ok()) return c.status();
  if (m.size() > kMaxTextBytes) {
    return err::ProtocolError(
        fmt::format("fabric: status message of {} bytes (limit {})", m.size(), kMaxTextBytes));
  }
  if (used) {
    *used = r.position();
  } else if (Status s = wire_codec::expect_end(kCodec, r, "status"); !s.ok()) {
    return s;
  }
  *out = *c == StatusCode::kOk ? Status::Ok() : Status(*c, std::move(m));
  return Status::Ok();
}

Bytes encode_grant_req(const GrantReq& g) {
  Bytes out;
  ByteWriter w(out);
  w.u64(g.region);
  w.u64(g.adv_offset);
  w.u64(g.adv_length);
  w.u64(g.key);
  w.u8(g.access);
  return out;
}

Result<GrantReq> decode_grant_req(ByteView body) {
  ByteReader r(body);
  GrantReq g;
  g.region = r.u64();
  g.adv_offset = r.u64();
  g.adv_length = r.u64();
  g.key = r.u64();
  g.access = r.u8();
  if (Status s = wire_codec::expect_end(kCodec, r, "GRANT_REQ"); !s.ok()) return s;
  return g;
}

Bytes encode_grant(const Grant& g) {
  Bytes out = encode_status(g.status);
  ByteWriter w(out);
  w.u64(g.mr_key);
  w.u64(g.base);
  return out;
}

Result<Grant> decode_grant(ByteView body) {
  size_t used = 0;
  Grant g;
  if (Status s = decode_status(body, &g.status, &used); !s.ok()) return s;
  ByteReader r(body.subspan(used));
  g.mr_key = r.u64();
  g.base = r.u64();
  if (Status s = wire_codec::expect_end(kCodec, r, "GRANT"); !s.ok()) return s;
  return g;
}

Bytes encode_u64(uint64_t v) {
  Bytes out;
  ByteWriter w(out);
  w.u64(v);
  return out;
}

Result<uint64_t> decode_u64(ByteView body, const char* what) {
  ByteReader r(body);
  const uint64_t v = r.u64();
  if (Status s = wire_codec::expect_end(kCodec, r, what); !s.ok()) return s;
  return v;
}

}  // namespace ferry::fabric
