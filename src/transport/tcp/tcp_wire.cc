#include "transport/tcp/tcp_wire.h"

#include <cstring>

#include "fmt/format.h"

namespace ferry::tcp {

const char* op_name(uint8_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kWrite:
      return "WRITE";
    case Op::kWriteAck:
      return "WRITE_ACK";
    case Op::kReadRequest:
      return "READ_REQUEST";
    case Op::kReadResponse:
      return "READ_RESPONSE";
    case Op::kNotify:
      return "NOTIFY";
    case Op::kNotifyAck:
      return "NOTIFY_ACK";
  }
  return "UNKNOWN";
}

Status validate_header(const FrameHeader& h) {
  if (h.magic != kFrameMagic) {
    return err::ProtocolError(
        fmt::format("bad frame magic {:#06x}, expected {:#06x}", h.magic, kFrameMagic));
  }
  const auto op = static_cast<Op>(h.op);
  switch (op) {
    case Op::kWrite:
    case Op::kReadRequest:
      if (h.count == 0 || h.count > kMaxSegmentsPerFrame) {
        return err::ProtocolError(fmt::format("{} frame with {} segments (allowed 1..{})",
                                              op_name(h.op), h.count, kMaxSegmentsPerFrame));
      }
      if (h.aux_bytes != uint64_t{h.count} * sizeof(WireSegment)) {
        return err::ProtocolError(fmt::format("{} frame: segment table is {} bytes, expected {}",
                                              op_name(h.op), h.aux_bytes,
                                              uint64_t{h.count} * sizeof(WireSegment)));
      }
      if (op == Op::kReadRequest && h.payload_bytes != 0) {
        return err::ProtocolError("READ_REQUEST frame carries payload");
      }
      if (h.payload_bytes > kMaxFramePayload) {
        return err::ProtocolError(fmt::format("{} frame payload {} exceeds the limit {}",
                                              op_name(h.op), h.payload_bytes, kMaxFramePayload));
      }
      return Status::Ok();
    case Op::kNotify:
      if (h.aux_bytes > kMaxNotificationBytes || h.payload_bytes != 0) {
        return err::ProtocolError(fmt::format("NOTIFY frame of {} bytes (limit {}) or with payload",
                                              h.aux_bytes, kMaxNotificationBytes));
      }
      return Status::Ok();
    case Op::kWriteAck:
    case Op::kNotifyAck:
    case Op::kReadResponse:
      if (h.aux_bytes > kMaxErrorMessage + ((h.flags & kFlagTrace) ? kMaxTraceTrailerBytes : 0)) {
        return err::ProtocolError(
            fmt::format("{} frame with a {}-byte message", op_name(h.op), h.aux_bytes));
      }
      if (h.status > static_cast<uint32_t>(StatusCode::kInternal)) {
        return err::ProtocolError(
            fmt::format("{} frame with unknown status {}", op_name(h.op), h.status));
      }
      if (op != Op::kReadResponse && h.payload_bytes != 0) {
        return err::ProtocolError(fmt::format("{} frame carries payload", op_name(h.op)));
      }
      if (h.payload_bytes > kMaxFramePayload || (h.status != 0 && h.payload_bytes != 0)) {
        return err::ProtocolError("READ_RESPONSE payload size is impossible");
      }
      return Status::Ok();
  }
  return err::ProtocolError(fmt::format("unknown opcode {}", h.op));
}

Result<size_t> trace_trailer_size(const FrameHeader& h, std::span<const uint8_t> aux) {
  if ((h.flags & kFlagTrace) == 0) return size_t{0};
  TraceTrailerHead head{};
  if (aux.size() >= sizeof head) std::memcpy(&head, aux.data(), sizeof head);
  const size_t size = sizeof head + size_t{8} * head.stages;
  if (aux.size() < sizeof head || head.stages == 0 || head.stages > kMaxTraceTrailerStages ||
      size > aux.size()) {
    return err::ProtocolError(fmt::format(
        "{} frame flagged with a stage trace trailer: {} bytes of aux, trailer of {} stages",
        op_name(h.op), aux.size(), head.stages));
  }
  return size;
}

Status check_segments(const FrameHeader& h, std::span<const WireSegment> segments,
                      uint64_t* total_bytes) {
  uint64_t total = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const uint64_t len = segments[i].length;
    if (len == 0 || len > kMaxFramePayload - total) {
      return err::ProtocolError(
          fmt::format("{} segment {} has length {} (frame total so far {}, limit {})",
                      op_name(h.op), i, len, total, kMaxFramePayload));
    }
    total += len;
  }
  if (static_cast<Op>(h.op) == Op::kWrite && total != h.payload_bytes) {
    return err::ProtocolError(
        fmt::format("WRITE segments add up to {} bytes, header says {}", total, h.payload_bytes));
  }
  *total_bytes = total;
  return Status::Ok();
}

}  // namespace ferry::tcp
