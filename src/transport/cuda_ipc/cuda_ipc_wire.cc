#include "transport/cuda_ipc/cuda_ipc_wire.h"

#include <fcntl.h>

#include <cerrno>

#include "core/byte_codec.h"
#include "ferry/gpu.h"
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
                                          static_cast<uint8_t>(Op::kCopyResponse),
                                          &op_rules};

Bytes frame(Op op, const Bytes& body) {
  return wire_codec::frame(kFormat, static_cast<uint8_t>(op), body);
}

// The handles of a grant or export: kind, pieces, where they lie.
void put_grant_body(ByteWriter& w, const Grant& g) {
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

// Reads what put_grant_body wrote; checks the pieces lie inside the span, in
// order, without gaps, and that the span covers the region address.
Status take_grant_body(ByteReader& r, const char* what, Grant* g) {
  const uint8_t kind = r.u8();
  r.bytes(3);
  const uint32_t count = r.u32();
  auto uuid = r.bytes(kUuidBytes);
  if (r.ok()) std::copy(uuid.begin(), uuid.end(), g->gpu_uuid.begin());
  g->buffer_id = r.u64();
  g->region_address = r.u64();
  g->span_base = r.u64();
  g->span_length = r.u64();
  if (!r.ok()) return err::ProtocolError(fmt::format("cuda_ipc: {} header truncated", what));
  if (kind != static_cast<uint8_t>(HandleKind::kLegacy) &&
      kind != static_cast<uint8_t>(HandleKind::kVmm)) {
    return err::ProtocolError(fmt::format("cuda_ipc: {} with unknown handle kind {}", what, kind));
  }
  g->kind = static_cast<HandleKind>(kind);
  if (count == 0 || count > kMaxPieces || (g->kind == HandleKind::kLegacy && count != 1)) {
    return err::ProtocolError(fmt::format("cuda_ipc: {} with {} pieces", what, count));
  }
  if (uint64_t{count} * kPieceBytes > r.remaining()) {
    return err::ProtocolError(
        fmt::format("cuda_ipc: {} announces {} pieces in {} bytes", what, count, r.remaining()));
  }
  g->pieces.resize(count);
  uint64_t next = 0;
  for (Piece& p : g->pieces) {
    p.offset = r.u64();
    p.length = r.u64();
    auto h = r.bytes(kLegacyHandleBytes);
    std::copy(h.begin(), h.end(), p.handle.begin());
    if (p.offset != next || p.length == 0 || p.length > g->span_length - p.offset) {
      return err::ProtocolError(
          fmt::format("cuda_ipc: {} piece [{}, +{}) is not the next piece of a {}-byte span at {}",
                      what, p.offset, p.length, g->span_length, next));
    }
    next = p.offset + p.length;
  }
  if (next != g->span_length) {
    return err::ProtocolError(fmt::format("cuda_ipc: {} pieces cover {} of the span's {} bytes",
                                          what, next, g->span_length));
  }
  if (g->region_address < g->span_base || g->region_address - g->span_base >= g->span_length) {
    return err::ProtocolError(
        fmt::format("cuda_ipc: {} region address {:#x} outside its span [{:#x}, +{})", what,
                    g->region_address, g->span_base, g->span_length));
  }
  return Status::Ok();
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
    case Op::kPushExport:
      return "PUSH_EXPORT";
    case Op::kCopyRequest:
      return "COPY_REQ";
    case Op::kCopyResponse:
      return "COPY_RESP";
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
    case Op::kPushExport:
      return 8 + 56 + uint64_t{kMaxPieces} * kPieceBytes;
    case Op::kCopyRequest:
      return kCopyRequestHeadBytes + uint64_t{kMaxCopySegments} * kCopySegmentBytes +
             kMaxNotificationBytes;
    case Op::kCopyResponse:
      return 16 + uint64_t{kMaxMessageBytes};
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
  wire_codec::put_access_tail(w, q.access);
  return frame(Op::kGrantRequest, body);
}

Bytes encode_grant(const Grant& g) {
  Bytes body;
  ByteWriter w(body);
  w.u64(g.request_id);
  wire_codec::put_status_head(kCodec, w, g.status);
  if (g.status.ok()) put_grant_body(w, g);
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
  uint16_t code = 0;
  uint32_t length = 0;
  if (Status s = wire_codec::take_status_head(kCodec, r, "HELLO_ACK", &code, &length); !s.ok()) {
    return s;
  }
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
  const bool tail_clear = wire_codec::take_access_tail(r, &q.access);
  if (Status s = wire_codec::expect_end(kCodec, r, "GRANT_REQ"); !s.ok()) return s;
  if (!tail_clear) return err::ProtocolError("cuda_ipc: GRANT_REQ has reserved bytes set");
  return q;
}

Result<Grant> decode_grant(ByteView body) {
  ByteReader r(body);
  Grant g;
  g.request_id = r.u64();
  uint16_t code = 0;
  uint32_t length = 0;
  if (Status s = wire_codec::take_status_head(kCodec, r, "GRANT", &code, &length); !s.ok())
    return s;
  if (!r.ok()) return err::ProtocolError("cuda_ipc: GRANT shorter than 16 bytes");
  if (code == static_cast<uint16_t>(StatusCode::kOk)) {
    if (Status s = take_grant_body(r, "GRANT", &g); !s.ok()) return s;
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

Bytes encode_push_export(const PushExport& e) {
  Bytes body;
  ByteWriter w(body);
  w.u64(e.export_id);
  put_grant_body(w, e.grant);
  return frame(Op::kPushExport, body);
}

Bytes encode_copy_request(const CopyRequest& q) {
  Bytes body;
  ByteWriter w(body);
  w.u64(q.id);
  w.u8(static_cast<uint8_t>(q.direction));
  w.u8(q.has_notification ? 1 : 0);
  w.u16(0);
  w.u32(static_cast<uint32_t>(q.segments.size()));
  w.u32(static_cast<uint32_t>(q.notification.size()));
  w.u32(0);
  for (const CopySegment& s : q.segments) {
    wire_codec::put_remote_range(w, s.remote);
    w.u64(s.export_id);
    w.u64(s.export_offset);
    wire_codec::put_access_tail(w, s.remote.access);
  }
  w.bytes(q.notification.data(), q.notification.size());
  return frame(Op::kCopyRequest, body);
}

Bytes encode_copy_response(const CopyResponse& a) {
  Bytes body;
  ByteWriter w(body);
  w.u64(a.request_id);
  wire_codec::put_status_head(kCodec, w, a.status);
  wire_codec::put_message(kCodec, w, a.status);
  return frame(Op::kCopyResponse, body);
}

Result<PushExport> decode_push_export(ByteView body) {
  ByteReader r(body);
  PushExport e;
  e.export_id = r.u64();
  if (!r.ok()) return err::ProtocolError("cuda_ipc: PUSH_EXPORT shorter than 8 bytes");
  if (Status s = take_grant_body(r, "PUSH_EXPORT", &e.grant); !s.ok()) return s;
  if (Status s = wire_codec::expect_end(kCodec, r, "PUSH_EXPORT"); !s.ok()) return s;
  e.grant.status = Status::Ok();
  return e;
}

Result<CopyRequest> decode_copy_request(ByteView body) {
  ByteReader r(body);
  CopyRequest q;
  q.id = r.u64();
  const uint8_t direction = r.u8();
  const uint8_t flags = r.u8();
  const uint16_t zero16 = r.u16();
  const uint32_t count = r.u32();
  const uint32_t notification = r.u32();
  const uint32_t zero32 = r.u32();
  if (!r.ok()) {
    return err::ProtocolError(
        fmt::format("cuda_ipc: COPY_REQ shorter than {} bytes", kCopyRequestHeadBytes));
  }
  if (direction != static_cast<uint8_t>(CopyDirection::kWrite) &&
      direction != static_cast<uint8_t>(CopyDirection::kRead)) {
    return err::ProtocolError(fmt::format("cuda_ipc: COPY_REQ with direction {}", direction));
  }
  q.direction = static_cast<CopyDirection>(direction);
  if ((flags & ~1u) != 0 || zero16 != 0 || zero32 != 0) {
    return err::ProtocolError(fmt::format("cuda_ipc: COPY_REQ with flags {:#x}", flags));
  }
  q.has_notification = (flags & 1u) != 0;
  if (count == 0 || count > kMaxCopySegments) {
    return err::ProtocolError(
        fmt::format("cuda_ipc: COPY_REQ with {} segments (1 to {})", count, kMaxCopySegments));
  }
  if (notification > kMaxNotificationBytes || (notification != 0 && !q.has_notification) ||
      (q.has_notification && q.direction != CopyDirection::kWrite)) {
    return err::ProtocolError(
        fmt::format("cuda_ipc: COPY_REQ with a {}-byte notification (flags {:#x}, direction {})",
                    notification, flags, direction));
  }
  if (uint64_t{count} * kCopySegmentBytes + notification != r.remaining()) {
    return err::ProtocolError(fmt::format(
        "cuda_ipc: COPY_REQ announces {} segments and {} notification bytes in {} bytes", count,
        notification, r.remaining()));
  }
  q.segments.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    CopySegment& s = q.segments[i];
    wire_codec::take_remote_range(r, &s.remote);
    s.export_id = r.u64();
    s.export_offset = r.u64();
    if (!wire_codec::take_access_tail(r, &s.remote.access)) {
      return err::ProtocolError(
          fmt::format("cuda_ipc: COPY_REQ segment {}: reserved bytes set", i));
    }
  }
  auto n = r.bytes(notification);
  q.notification.assign(n.begin(), n.end());
  if (Status s = wire_codec::expect_end(kCodec, r, "COPY_REQ"); !s.ok()) return s;
  return q;
}

Result<CopyResponse> decode_copy_response(ByteView body) {
  ByteReader r(body);
  CopyResponse a;
  a.request_id = r.u64();
  uint16_t code = 0;
  uint32_t length = 0;
  if (Status s = wire_codec::take_status_head(kCodec, r, "COPY_RESP", &code, &length); !s.ok()) {
    return s;
  }
  if (!r.ok()) return err::ProtocolError("cuda_ipc: COPY_RESP shorter than 16 bytes");
  if (Status s = wire_codec::take_status(kCodec, r, code, length, "COPY_RESP", &a.status);
      !s.ok()) {
    return s;
  }
  return a;
}

Status prepare_control_socket(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return err::Internal(
        fmt::format("cuda_ipc: fcntl on the control socket: {}", unix_socket::errno_text(errno)));
  }
  return Status::Ok();
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
  for (size_t i = 0; i < a.gpus.size(); ++i) {
    w.bytes(a.gpus[i].data(), a.gpus[i].size());
    w.u32(i < a.gpu_pci.size() ? a.gpu_pci[i] : 0);
  }
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
  if (format != kAddressFormat && format != kAddressFormatUuidOnly) {
    return err::InvalidArgument(
        fmt::format("cuda_ipc address format {} (this build reads {} and {})", format,
                    kAddressFormatUuidOnly, kAddressFormat));
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
    a.gpu_pci.push_back(format == kAddressFormat ? r.u32() : 0);
  }
  auto p = r.bytes(path_length);
  if (!r.ok() || r.remaining() != 0) {
    return err::InvalidArgument("cuda_ipc address: length does not match its fields");
  }
  a.socket_path.assign(reinterpret_cast<const char*>(p.data()), p.size());
  return a;
}

std::string gpu_text(const Address& a, size_t i) {
  if (i >= a.gpus.size()) return "no GPU";
  const uint32_t pci = i < a.gpu_pci.size() ? a.gpu_pci[i] : 0;
  return pci == 0 ? uuid_text(a.gpus[i])
                  : fmt::format("{} ({})", uuid_text(a.gpus[i]), pci_bus_id_text(pci));
}

std::string uuid_text(const std::array<uint8_t, kUuidBytes>& u) {
  return fmt::format(
      "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-"
      "{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
      u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
      u[15]);
}

}  // namespace ferry::cuda_ipc
