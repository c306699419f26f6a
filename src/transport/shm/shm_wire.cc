#include "transport/shm/shm_wire.h"

#include <algorithm>

#include "core/byte_codec.h"
#include "fmt/format.h"
#include "transport/common/wire_codec.h"

namespace ferry::shm {
namespace {

// No prefix: the transport says "shm" and where around these messages.
constexpr wire_codec::Codec kCodec{"", kMaxMessageBytes};

wire_codec::OpRules op_rules(uint8_t value) {
  const Op op = static_cast<Op>(value);
  const uint8_t flags = op == Op::kWriteReq  ? kFlagNotification | kFlagStaged
                        : op == Op::kReadReq ? kFlagStaged
                                             : 0;
  const bool handshake = op == Op::kHello || op == Op::kHelloAck || op == Op::kHelloDone;
  return {op_name(op), max_body_bytes(op), flags, handshake};
}

constexpr wire_codec::FrameFormat kFormat{kCodec,
                                          kFrameMagic,
                                          kWireVersion,
                                          static_cast<uint8_t>(Op::kHello),
                                          static_cast<uint8_t>(Op::kRingWake),
                                          &op_rules};

Bytes frame(Op op, const Bytes& body, uint8_t flags = 0) {
  return wire_codec::frame(kFormat, static_cast<uint8_t>(op), body, flags);
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kHello:
      return "HELLO";
    case Op::kHelloAck:
      return "HELLO_ACK";
    case Op::kHelloDone:
      return "HELLO_DONE";
    case Op::kWriteReq:
      return "WRITE_REQ";
    case Op::kReadReq:
      return "READ_REQ";
    case Op::kNotifyReq:
      return "NOTIFY_REQ";
    case Op::kResponse:
      return "RESPONSE";
    case Op::kCancel:
      return "CANCEL";
    case Op::kRing:
      return "RING";
    case Op::kRingWake:
      return "RING_WAKE";
  }
  return "UNKNOWN";
}

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kAuto:
      return "auto";
    case Mode::kCma:
      return "cma";
    case Mode::kStaging:
      return "staging";
  }
  return "unknown";
}

namespace {
Result<Mode> take_mode(uint8_t value, const char* what) {
  if (value > static_cast<uint8_t>(Mode::kStaging)) {
    return err::ProtocolError(fmt::format("{} with unknown mode {}", what, value));
  }
  return static_cast<Mode>(value);
}
}  // namespace

uint64_t max_body_bytes(Op op) {
  switch (op) {
    case Op::kHello:
    case Op::kHelloAck:
    case Op::kHelloDone:
      return kMaxHandshakeBody;
    case Op::kWriteReq:
    case Op::kReadReq:
    case Op::kNotifyReq:
      return kRequestFixedBytes + uint64_t{kMaxRequestSegments} * kSegmentBytes +
             kMaxNotificationBytes;
    case Op::kResponse:
      return kResponseFixedBytes + kMaxMessageBytes;
    case Op::kCancel:
      return 8 + uint64_t{kMaxCancelIds} * 8;
    case Op::kRing:
      return kRingBodyBytes;
    case Op::kRingWake:
      return 0;
  }
  return 0;
}

Result<FrameHeader> decode_header(ByteView bytes) {
  auto h = wire_codec::decode_header(kFormat, bytes);
  if (!h.ok()) return h.status();
  return FrameHeader{h->version, static_cast<Op>(h->op), h->flags, h->body_bytes};
}

// ---------------------------------------------------------------- requests ---

Bytes encode_request(Op op, uint64_t id, std::span<const WireSegment> segments,
                     bool has_notification, ByteView notification, bool staged) {
  Bytes body;
  body.reserve(kRequestFixedBytes + segments.size() * kSegmentBytes + notification.size());
  ByteWriter w(body);
  w.u64(id);
  w.u32(static_cast<uint32_t>(segments.size()));
  w.u32(static_cast<uint32_t>(notification.size()));
  for (const WireSegment& s : segments) {
    wire_codec::put_remote_range(w, s.remote);
    w.u64(s.address);
    wire_codec::put_access_tail(w, s.remote.access);
  }
  w.bytes(notification.data(), notification.size());
  uint8_t flags = op == Op::kWriteReq && has_notification ? kFlagNotification : 0;
  if (staged && op != Op::kNotifyReq) flags |= kFlagStaged;
  return frame(op, body, flags);
}

Result<Request> decode_request(const FrameHeader& header, ByteView body) {
  const Op op = header.op;
  const char* name = op_name(op);
  if (!is_request(op)) return err::ProtocolError(fmt::format("{} is not a request", name));
  ByteReader r(body);
  Request req;
  req.op = op;
  req.staged = (header.flags & kFlagStaged) != 0;
  req.id = r.u64();
  const uint32_t count = r.u32();
  const uint32_t note_bytes = r.u32();
  if (!r.ok()) {
    return err::ProtocolError(fmt::format("truncated {} ({} body bytes)", name, body.size()));
  }
  const bool want_segments = op != Op::kNotifyReq;
  if (want_segments ? (count == 0 || count > kMaxRequestSegments) : count != 0) {
    return err::ProtocolError(fmt::format("{} {} with {} segments (allowed {})", name, req.id,
                                          count, want_segments ? "1..1024" : "none"));
  }
  req.has_notification =
      op == Op::kNotifyReq || (op == Op::kWriteReq && (header.flags & kFlagNotification) != 0);
  if (note_bytes > kMaxNotificationBytes || (!req.has_notification && note_bytes != 0)) {
    return err::ProtocolError(fmt::format("{} {} with a notification of {} bytes (limit {})", name,
                                          req.id, note_bytes,
                                          req.has_notification ? kMaxNotificationBytes : 0));
  }
  const uint64_t expected = kRequestFixedBytes + uint64_t{count} * kSegmentBytes + note_bytes;
  if (body.size() != expected) {
    return err::ProtocolError(
        fmt::format("{} {}: body of {} bytes, {} segments and {} "
                    "notification bytes need exactly {}",
                    name, req.id, body.size(), count, note_bytes, expected));
  }
  req.segments.resize(count);
  uint64_t total = 0;
  for (uint32_t i = 0; i < count; ++i) {
    WireSegment& s = req.segments[i];
    wire_codec::take_remote_range(r, &s.remote);
    s.address = r.u64();
    if (!wire_codec::take_access_tail(r, &s.remote.access)) {
      return err::ProtocolError(
          fmt::format("{} {} segment {}: reserved bytes set", name, req.id, i));
    }
    // Zero-length or wrapping ranges are impossible for an initiator that
    // checked its own iovs; refuse them before anyone computes with them.
    // (A staged request's offset 0 is the start of the area.)
    if (s.remote.length == 0 || (s.address == 0 && !req.staged) ||
        s.address + s.remote.length < s.address || total + s.remote.length < total) {
      return err::ProtocolError(
          fmt::format("{} {} segment {}: impossible range address {:#x} length {}", name, req.id, i,
                      s.address, s.remote.length));
    }
    total += s.remote.length;
  }
  auto note = r.bytes(note_bytes);
  req.notification.assign(note.begin(), note.end());
  if (!r.ok()) return err::ProtocolError(fmt::format("truncated {} {}", name, req.id));
  return req;
}

// --------------------------------------------------------------- responses ---

Bytes encode_response(uint64_t id, const Status& status) {
  Bytes body;
  ByteWriter w(body);
  w.u64(id);
  wire_codec::put_status_head(kCodec, w, status);
  wire_codec::put_message(kCodec, w, status);
  return frame(Op::kResponse, body);
}

Result<Response> decode_response(ByteView body) {
  ByteReader r(body);
  Response resp;
  resp.id = r.u64();
  uint16_t code = 0;
  uint32_t length = 0;
  if (Status s = wire_codec::take_status_head(kCodec, r, "RESPONSE", &code, &length); !s.ok()) {
    return s;
  }
  if (!r.ok()) return err::ProtocolError(fmt::format("truncated RESPONSE ({} bytes)", body.size()));
  if (Status s = wire_codec::take_status(kCodec, r, code, length, "RESPONSE", &resp.status);
      !s.ok()) {
    return s;
  }
  return resp;
}

// ------------------------------------------------------------------ cancel ---

Bytes encode_cancel(std::span<const uint64_t> ids) {
  Bytes body;
  ByteWriter w(body);
  w.u32(static_cast<uint32_t>(ids.size()));
  w.u32(0);
  for (uint64_t id : ids) w.u64(id);
  return frame(Op::kCancel, body);
}

Result<std::vector<uint64_t>> decode_cancel(ByteView body) {
  ByteReader r(body);
  const uint32_t count = r.u32();
  const uint32_t reserved = r.u32();
  if (!r.ok() || reserved != 0 || count == 0 || count > kMaxCancelIds ||
      body.size() != 8 + uint64_t{count} * 8) {
    return err::ProtocolError(fmt::format("malformed CANCEL: {} bytes for {} ids (1 to {} allowed)",
                                          body.size(), count, kMaxCancelIds));
  }
  std::vector<uint64_t> ids(count);
  for (auto& id : ids) id = r.u64();
  return ids;
}

// -------------------------------------------------------------------- ring ---

Bytes encode_ring(uint64_t ring_bytes) {
  Bytes body;
  ByteWriter w(body);
  w.u64(ring_bytes);
  return frame(Op::kRing, body);
}

Result<uint64_t> decode_ring(ByteView body) {
  if (body.size() != kRingBodyBytes) {
    return err::ProtocolError(
        fmt::format("RING of {} bytes, expected {}", body.size(), kRingBodyBytes));
  }
  ByteReader r(body);
  return r.u64();
}

Bytes encode_ring_wake() {
  return frame(Op::kRingWake, Bytes{});
}

// --------------------------------------------------------------- handshake ---

namespace {
// The message of a handshake frame: the error when status is not Ok, else the
// probe refusal (kHandshakeCmaRefused), else empty.
const std::string& handshake_message(const Status& status, const std::string& refusal) {
  return status.ok() ? refusal : status.message();
}

void put_handshake_head(ByteWriter& w, const Status& status, Mode mode, uint8_t flags,
                        const std::string& message) {
  w.u16(static_cast<uint16_t>(status.code()));
  w.u8(static_cast<uint8_t>(mode));
  w.u8(flags);
  w.u32(static_cast<uint32_t>(wire_codec::clipped(kCodec, message).size()));
}

uint8_t handshake_flags(const Status& status, const std::string& refusal, uint64_t staging_bytes) {
  uint8_t flags = 0;
  if (status.ok() && !refusal.empty()) flags |= kHandshakeCmaRefused;
  if (status.ok() && staging_bytes > 0) flags |= kHandshakeArea;
  return flags;
}

// Reads the message into `status` (not Ok) or `refusal` (Ok with
// kHandshakeCmaRefused), and checks the flags against the status.
Status take_handshake_message(ByteReader& r, uint16_t code, uint8_t flags, uint32_t length,
                              uint64_t staging_bytes, const char* what, Status* status,
                              std::string* refusal) {
  if ((flags & ~(kHandshakeCmaRefused | kHandshakeArea | kHandshakeRing)) != 0) {
    return err::ProtocolError(fmt::format("{} with unknown flags {:#04x}", what, flags));
  }
  if (Status s = wire_codec::take_status(kCodec, r, code, length, what, status); !s.ok()) return s;
  if (!status->ok() && flags != 0) {
    return err::ProtocolError(fmt::format("{}: a refusal with flags {:#04x}", what, flags));
  }
  if (((flags & kHandshakeArea) != 0) != (staging_bytes > 0)) {
    return err::ProtocolError(fmt::format("{}: staging area flag {} with a size of {} bytes", what,
                                          (flags & kHandshakeArea) != 0, staging_bytes));
  }
  if (status->ok()) {
    const bool refused = (flags & kHandshakeCmaRefused) != 0;
    if (refused == status->message().empty()) {
      return err::ProtocolError(fmt::format("{}: probe refusal flag {} with a message of {} bytes",
                                            what, refused, length));
    }
    *refusal = status->message();
    *status = Status::Ok();
  }
  return Status::Ok();
}
}  // namespace

Bytes encode_hello(const Hello& hello) {
  Bytes body;
  ByteWriter w(body);
  w.u64(hello.engine_id);
  w.u64(hello.expected_engine_id);
  w.u64(hello.probe_address);
  w.u32(hello.probe_length);
  w.u8(static_cast<uint8_t>(hello.mode));
  w.u8(0);
  w.u16(0);
  w.u64(hello.probe_value);
  return frame(Op::kHello, body);
}

Result<Hello> decode_hello(ByteView body) {
  if (body.size() != kHelloBytes) {
    return err::ProtocolError(
        fmt::format("HELLO of {} bytes, expected {}", body.size(), kHelloBytes));
  }
  ByteReader r(body);
  Hello h;
  h.engine_id = r.u64();
  h.expected_engine_id = r.u64();
  h.probe_address = r.u64();
  h.probe_length = r.u32();
  const uint8_t mode = r.u8();
  const uint8_t reserved8 = r.u8();
  const uint16_t reserved16 = r.u16();
  h.probe_value = r.u64();
  if (h.engine_id == 0 || h.probe_address == 0 || h.probe_length != kProbeBytes || reserved8 != 0 ||
      reserved16 != 0) {
    return err::ProtocolError(
        fmt::format("malformed HELLO: engine {:016x}, probe {:#x} of {} bytes", h.engine_id,
                    h.probe_address, h.probe_length));
  }
  auto m = take_mode(mode, "HELLO");
  if (!m.ok()) return m.status();
  h.mode = *m;
  return h;
}

Bytes encode_hello_ack(const HelloAck& ack) {
  Bytes body;
  ByteWriter w(body);
  const std::string& message = handshake_message(ack.status, ack.cma_refusal);
  put_handshake_head(w, ack.status, ack.mode,
                     handshake_flags(ack.status, ack.cma_refusal, ack.staging_bytes), message);
  w.u64(ack.engine_id);
  w.u64(ack.probe_address);
  w.u32(ack.probe_length);
  w.u32(ack.status.ok() ? ack.features : 0);
  w.u64(ack.probe_value);
  w.u64(ack.status.ok() ? ack.staging_bytes : 0);
  const std::string_view m = wire_codec::clipped(kCodec, message);
  w.bytes(m.data(), m.size());
  return frame(Op::kHelloAck, body);
}

Result<HelloAck> decode_hello_ack(ByteView body) {
  ByteReader r(body);
  HelloAck a;
  const uint16_t code = r.u16();
  const uint8_t mode = r.u8();
  const uint8_t flags = r.u8();
  const uint32_t length = r.u32();
  a.engine_id = r.u64();
  a.probe_address = r.u64();
  a.probe_length = r.u32();
  // Unknown bits are ignored, as older engines ignored the whole field.
  a.features = r.u32() & (kFeatureGpuAreas | kFeatureRequestRing);
  a.probe_value = r.u64();
  a.staging_bytes = r.u64();
  if (!r.ok())
    return err::ProtocolError(fmt::format("truncated HELLO_ACK ({} bytes)", body.size()));
  auto m = take_mode(mode, "HELLO_ACK");
  if (!m.ok()) return m.status();
  a.mode = *m;
  if (Status s = take_handshake_message(r, code, flags, length, a.staging_bytes, "HELLO_ACK",
                                        &a.status, &a.cma_refusal);
      !s.ok()) {
    return s;
  }
  if (a.status.ok() &&
      (a.engine_id == 0 || a.probe_address == 0 || a.probe_length != kProbeBytes)) {
    return err::ProtocolError(
        fmt::format("malformed HELLO_ACK: engine {:016x}, probe {:#x} of {} bytes", a.engine_id,
                    a.probe_address, a.probe_length));
  }
  return a;
}

Bytes encode_hello_done(const HelloDone& done) {
  Bytes body;
  ByteWriter w(body);
  const std::string& message = handshake_message(done.status, done.cma_refusal);
  uint8_t flags = handshake_flags(done.status, done.cma_refusal, done.staging_bytes);
  if (done.status.ok() && done.request_ring) flags |= kHandshakeRing;
  put_handshake_head(w, done.status, done.status.ok() ? done.mode : Mode::kAuto, flags, message);
  w.u64(done.status.ok() ? done.staging_bytes : 0);
  const std::string_view m = wire_codec::clipped(kCodec, message);
  w.bytes(m.data(), m.size());
  return frame(Op::kHelloDone, body);
}

Result<HelloDone> decode_hello_done(ByteView body) {
  ByteReader r(body);
  HelloDone d;
  const uint16_t code = r.u16();
  const uint8_t mode = r.u8();
  const uint8_t flags = r.u8();
  const uint32_t length = r.u32();
  d.staging_bytes = r.u64();
  if (!r.ok()) {
    return err::ProtocolError(fmt::format("truncated HELLO_DONE ({} bytes)", body.size()));
  }
  auto m = take_mode(mode, "HELLO_DONE");
  if (!m.ok()) return m.status();
  d.mode = *m;
  if (Status s = take_handshake_message(r, code, flags, length, d.staging_bytes, "HELLO_DONE",
                                        &d.status, &d.cma_refusal);
      !s.ok()) {
    return s;
  }
  if (d.status.ok() && d.mode == Mode::kAuto) {
    return err::ProtocolError("HELLO_DONE accepts the connection but names no mode");
  }
  d.request_ring = (flags & kHandshakeRing) != 0;
  // Staging needs the area; cross-memory attach may bring one for GPU memory
  // (kFeatureGpuAreas), which the acceptor checks against what it offered.
  if (d.status.ok() && d.mode == Mode::kStaging && d.staging_bytes == 0) {
    return err::ProtocolError(
        fmt::format("HELLO_DONE chooses {} mode with a staging area of {} bytes", mode_name(d.mode),
                    d.staging_bytes));
  }
  return d;
}

// ----------------------------------------------------------------- address ---

Bytes encode_address(const ShmAddress& address) {
  Bytes out;
  ByteWriter w(out);
  w.u8(kAddressFormat);
  w.u8(0);
  w.u16(static_cast<uint16_t>(address.socket_path.size()));
  w.u32(address.pid);
  w.bytes(address.socket_path.data(), address.socket_path.size());
  return out;
}

Result<ShmAddress> decode_address(ByteView bytes) {
  ByteReader r(bytes);
  const uint8_t format = r.u8();
  (void)r.u8();
  const uint16_t length = r.u16();
  ShmAddress a;
  a.pid = r.u32();
  if (!r.ok()) return err::InvalidArgument("shm address is truncated");
  if (format != kAddressFormat) {
    return err::InvalidArgument(fmt::format("shm address of format {}, this engine reads format {}",
                                            format, kAddressFormat));
  }
  if (length == 0 || length > kMaxSocketPath || length != r.remaining()) {
    return err::InvalidArgument(fmt::format("shm address: socket path of {} bytes in {} (limit {})",
                                            length, r.remaining(), kMaxSocketPath));
  }
  auto p = r.bytes(length);
  a.socket_path.assign(reinterpret_cast<const char*>(p.data()), p.size());
  if (a.socket_path.front() != '/' || a.socket_path.find('\0') != std::string::npos) {
    return err::InvalidArgument("shm address: socket path is not an absolute path");
  }
  return a;
}

}  // namespace ferry::shm
