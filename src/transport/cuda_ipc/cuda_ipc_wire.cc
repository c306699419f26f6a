#include "transport/cuda_ipc/cuda_ipc_wire.h"

#include "core/byte_codec.h"
#include "fmt/format.h"
#include "transport/common/unix_socket.h"
#include "transport/common/wire_codec.h"

namespace ferry::cuda_ipc {
namespace {

constexpr wire_codec::Codec kCodec{"cuda_ipc: ", kMaxMessageBytes};

wire_codec::OpRules op_rules(uint8_t value) {
  const Op op = static_cast<Op>(value);
  return {op_name(op), max_body_bytes(op), 0, op == Op::kHello || op == Op::kHelloAck};
}

constexpr wire_codec::FrameFormat kFormat{kCodec,
                                          kFrameMagic,
                                          kWireVersion,
                                          static_cast<uint8_t>(Op::kHello),
                                          static_cast<uint8_t>(Op::kNotify),
                                          &op_rules};

Bytes frame(Op op, const Bytes& body) {
  return wire_codec::frame(kFormat, static_cast<uint8_t>(op), body);
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kHello:
      return "HELLO";
    case Op::kHelloAck:
      return "HELLO_ACK";
    case Op::kGrantRequest:
      return "GRANT_REQ";
    case Op::kGrant:
      return "GRANT";
    case Op::kFds:
      return "FDS";
    case Op::kRevoke:
      return "REVOKE";
    case Op::kRevokeAck:
      return "REVOKE_ACK";
    case Op::kNotify:
      return "NOTIFY";
  }
  return "UNKNOWN";
}

uint64_t max_body_bytes(Op op) {
  switch (op) {
    case Op::kHello:
    case Op::kHelloAck:
      return kMaxHandshakeBody;
    case Op::kGrantRequest:
      return kGrantRequestBytes;
    case Op::kGrant:
      return 16 + 56 + uint64_t{kMaxPieces} * kPieceBytes + kMaxMessageBytes;
    case Op::kFds:
      return 8;
    case Op::kRevoke:
    case Op::kRevokeAck:
      return 8 + uint64_t{kMaxRevokeIds} * 8;
    case Op::kNotify:
      return 8 + uint64_t{kMaxNotificationBytes};
  }
  return 0;
}

Result<FrameHeader> decode_header(ByteView bytes) {
  auto h = wire_codec::decode_header(kFormat, bytes);
  if (!h.ok()) return h.status();
  return FrameHeader{h->version, static_cast<Op>(h->op), h->body_bytes};
}

Bytes encode_hello(const Hello& hello) {
  Bytes body;
  ByteWriter w(body);
  w.u64(hello.engine_id);
  w.u64(hello.expected_engine_id);
  return frame(Op::kHello, body);
}

Bytes encode_hello_ack(const HelloAck& ack) {
  Bytes body;
  ByteWriter w(body);
  wire_codec::put_status_head(kCodec, w, ack.status);
  w.u64(ack.engine_id);
  wire_codec::put_message(kCodec, w, ack.status);
  return frame(Op::kHelloAck, body);
}

Bytes encode_grant_request(const GrantRequest& q) {
  Bytes body;
  ByteWriter w(body);
  w.u64(q.id);
  w.u64(q.region_id);
  w.u64(q.adv_offset);
  w.u64(q.adv_length);
  w.u64(q.key);
  w.u8(q.access);
  for (int i = 0; i < 7; ++i) w.u8(0);
  return frame(Op::kGrantRequest, body);
}

Bytes encode_grant(const Grant& g) {
  Bytes body;
  ByteWriter w(body);
  w.u64(g.request_id);
  wire_codec::put_status_head(kCodec, w, g.status);
  if (g.status.ok()) {
    w.u8(static_cast<uint8_t>(g.kind));
    w.u8(0);
    w.u8(0);
    w.u8(0);
    w.u32(static_cast<uint32_t>(g.pieces.size()));
    w.bytes(g.gpu_uuid.data(), g.gpu_uuid.size());
    w.u64(g.buffer_id);
    w.u64(g.region_address);
    w.u64(g.span_base);
    w.u64(g.span_length);
    for (const Piece& p : g.pieces) {
      w.u64(p.offset);
      w.u64(p.length);
      w.bytes(p.handle.data(), p.handle.size());
    }
  }
  wire_codec::put_message(kCodec, w, g.status);
  return frame(Op::kGrant, body);
}

Bytes encode_fds(uint32_t count) {
  Bytes body;
  ByteWriter w(body);
  w.u32(count);
  w.u32(0);
  return frame(Op::kFds, body);
}

Bytes encode_revoke(Op op, std::span<const uint64_t> region_ids) {
  Bytes body;
  ByteWriter w(body);
  w.u32(static_cast<uint32_t>(region_ids.size()));
  w.u32(0);
  for (uint64_t id : region_ids) w.u64(id);
  return frame(op, body);
}

Bytes encode_notify(ByteView payload) {
  Bytes body;
  ByteWriter w(body);
  w.u32(static_cast<uint32_t>(payload.size()));
  w.u32(0);
  w.bytes(payload.data(), payload.size());
  return frame(Op::kNotify, body);
}

Result<Hello> decode_hello(ByteView body) {
  // A newer peer's HELLO may be longer; its known prefix is read.
  ByteReader r(body);
  Hello h;
  h.engine_id = r.u64();
  h.expected_engine_id = r.u64();
  if (!r.ok()) return err::ProtocolError("cuda_ipc: HELLO shorter than 16 bytes");
  return h;
}

Result<HelloAck> decode_hello_ack(ByteView body) {
  ByteReader r(body);
  const uint16_t code = r.u16();
  r.u16();
  const uint32_t length = r.u32();
  HelloAck a;
  a.engine_id = r.u64();
  if (!r.ok()) return err::ProtocolError("cuda_ipc: HELLO_ACK shorter than 16 bytes");
  if (Status s = wire_codec::take_status(kCodec, r, code, length, "HELLO_ACK", &a.status);
      !s.ok()) {
    return s;
  }
  return a;
}

Result<GrantRequest> decode_grant_request(ByteView body) {
  ByteReader r(body);
  GrantRequest q;
  q.id = r.u64();
  q.region_id = r.u64();
  q.adv_offset = r.u64();
  q.adv_length = r.u64();
  q.key = r.u64();
  q.access = r.u8();
  r.bytes(7);
  if (Status s = wire_codec::expect_end(kCodec, r, "GRANT_REQ"); !s.ok()) return s;
  return q;
}

Result<Grant> decode_grant(ByteView body) {
  ByteReader r(body);
  Grant g;
  g.request_id = r.u64();
  const uint16_t code = r.u16();
  r.u16();
  const uint32_t length = r.u32();
  if (!r.ok()) return err::ProtocolError("cuda_ipc: GRANT shorter than 16 bytes");
  if (code == static_cast<uint16_t>(StatusCode::kOk)) {
    const uint8_t kind = r.u8();
    r.bytes(3);
    const uint32_t count = r.u32();
    auto uuid = r.bytes(kUuidBytes);
    if (r.ok()) std::copy(uuid.begin(), uuid.end(), g.gpu_uuid.begin());
    g.buffer_id = r.u64();
    g.region_address = r.u64();
    g.span_base = r.u64();
    g.span_length = r.u64();
    if (!r.ok()) return err::ProtocolError("cuda_ipc: GRANT header truncated");
    if (kind != static_cast<uint8_t>(HandleKind::kLegacy) &&
        kind != static_cast<uint8_t>(HandleKind::kVmm)) {
      return err::ProtocolError(fmt::format("cuda_ipc: GRANT with unknown handle kind {}", kind));
    }
    g.kind = static_cast<HandleKind>(kind);
    if (count == 0 || count > kMaxPieces || (g.kind == HandleKind::kLegacy && count != 1)) {
      return err::ProtocolError(fmt::format("cuda_ipc: GRANT with {} pieces", count));
    }
    if (uint64_t{count} * kPieceBytes > r.remaining()) {
      return err::ProtocolError(
          fmt::format("cuda_ipc: GRANT announces {} pieces in {} bytes", count, r.remaining()));
    }
    g.pieces.resize(count);
    uint64_t next = 0;
    for (Piece& p : g.pieces) {
      p.offset = r.u64();
      p.length = r.u64();
      auto h = r.bytes(kLegacyHandleBytes);
      std::copy(h.begin(), h.end(), p.handle.begin());
      if (p.offset != next || p.length == 0 || p.length > g.span_length - p.offset) {
        return err::ProtocolError(fmt::format(
            "cuda_ipc: GRANT piece [{}, +{}) is not the next piece of a {}-byte span at {}",
            p.offset, p.length, g.span_length, next));
      }
      next = p.offset + p.length;
    }
    if (next != g.span_length) {
      return err::ProtocolError(fmt::format(
          "cuda_ipc: GRANT pieces cover {} of the span's {} bytes", next, g.span_length));
    }
    if (g.region_address < g.span_base || g.region_address - g.span_base >= g.span_length) {
      return err::ProtocolError(
          fmt::format("cuda_ipc: GRANT region address {:#x} outside its span [{:#x}, +{})",
                      g.region_address, g.span_base, g.span_length));
    }
    g.status = Status::Ok();
    if (length != 0 || r.remaining() != 0) {
      return err::ProtocolError("cuda_ipc: GRANT with trailing bytes");
    }
    return g;
  }
  if (Status s = wire_codec::take_status(kCodec, r, code, length, "GRANT", &g.status); !s.ok()) {
    return s;
  }
  return g;
}

Result<uint32_t> decode_fds(ByteView body) {
  ByteReader r(body);
  const uint32_t count = r.u32();
  const uint32_t zero = r.u32();
  if (Status s = wire_codec::expect_end(kCodec, r, "FDS"); !s.ok()) return s;
  if (count == 0 || count > kMaxFdsPerFrame || zero != 0) {
    return err::ProtocolError(fmt::format("cuda_ipc: FDS announcing {} descriptors", count));
  }
  return count;
}

Result<std::vector<uint64_t>> decode_revoke(ByteView body) {
  ByteReader r(body);
  const uint32_t count = r.u32();
  r.u32();
  if (!r.ok() || count > kMaxRevokeIds || uint64_t{count} * 8 != r.remaining()) {
    return err::ProtocolError("cuda_ipc: REVOKE with a count that does not match its body");
  }
  std::vector<uint64_t> ids(count);
  for (uint64_t& id : ids) id = r.u64();
  return ids;
}

Bytes encode_address(const Address& a) {
  Bytes out;
  ByteWriter w(out);
  w.u8(kAddressFormat);
  w.u8(0);
  w.u16(static_cast<uint16_t>(a.socket_path.size()));
  w.u32(a.pid);
  w.u16(static_cast<uint16_t>(a.gpus.size()));
  w.u16(0);
  for (const auto& g : a.gpus) w.bytes(g.data(), g.size());
  w.bytes(a.socket_path.data(), a.socket_path.size());
  return out;
}

Result<Address> decode_address(ByteView bytes) {
  ByteReader r(bytes);
  const uint8_t format = r.u8();
  r.u8();
  const uint16_t path_length = r.u16();
  Address a;
  a.pid = r.u32();
  const uint16_t gpus = r.u16();
  r.u16();
  if (!r.ok()) return err::InvalidArgument("cuda_ipc address: truncated");
  if (format != kAddressFormat) {
    return err::InvalidArgument(
        fmt::format("cuda_ipc address format {} (this build reads {})", format, kAddressFormat));
  }
  if (gpus > kMaxAddressGpus || path_length == 0 || path_length > unix_socket::kMaxPath) {
    return err::InvalidArgument(
        fmt::format("cuda_ipc address: {} GPUs, path of {} bytes", gpus, path_length));
  }
  for (uint16_t i = 0; i < gpus; ++i) {
    auto u = r.bytes(kUuidBytes);
    std::array<uint8_t, kUuidBytes> uuid{};
    if (r.ok()) std::copy(u.begin(), u.end(), uuid.begin());
    a.gpus.push_back(uuid);
  }
  auto p = r.bytes(path_length);
  if (!r.ok() || r.remaining() != 0) {
    return err::InvalidArgument("cuda_ipc address: length does not match its fields");
  }
  a.socket_path.assign(reinterpret_cast<const char*>(p.data()), p.size());
  return a;
}

std::string uuid_text(const std::array<uint8_t, kUuidBytes>& u) {
  return fmt::format(
      "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-"
      "{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
      u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
      u[15]);
}

}  // namespace ferry::cuda_ipc
