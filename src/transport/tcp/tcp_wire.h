// The tcp transport's wire format (docs/protocol.md explains it in prose).
//
// Every stream starts with a Hello from the connecting side and a HelloReply
// from the accepting side. Where both engines speak handshake revision 2, the
// first stream of a connection also carries both engines' metadata (below).
// After that both directions carry frames: a fixed
// 32-byte FrameHeader, `aux_bytes` of auxiliary data (segment table, error
// message or notification), then `payload_bytes` of data. Requests (WRITE,
// READ_REQUEST, NOTIFY) may flow either way; each stream answers requests in
// the order they arrived, so responses match the requester's FIFO.
// All integers are little endian; structs are laid out without padding.
#pragma once

#include <bit>
#include <cstdint>
#include <span>

#include "core/version.h"
#include "ferry/status.h"

namespace ferry::tcp {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little endian; add byte swapping for this host");

constexpr uint32_t kHelloMagic = 0x59525246;  // "FRRY"
using ferry::kProtocolVersion;
constexpr uint16_t kFrameMagic = 0xF7E5;
// Largest payload of a frame that touches GPU memory on either side: one
// staging slot (transport/common/gpu_staging.h). Part of the protocol (both
// sides rely on it).
constexpr uint64_t kGpuFramePayload = 1 << 20;

// Handshake revisions, negotiated per stream as the lower of both sides'
// (engines before revision 2 send 0 in the field, read as 1; frames are the
// same in every revision, so the protocol version stays):
//   1: Hello, HelloReply.
//   2: on a stream whose Hello declares metadata_bytes > 0, the reply of an
//      engine that agrees to 2 is followed by its metadata (message_bytes of
//      it); the connecting side checks it, sends its own metadata_bytes,
//      and the accepting side, having checked those, answers with a second
//      HelloReply (status 0, or a refusal and its message). The stream
//      carries frames after that. Connect by address then knows the peer as
//      connect by metadata does (docs/protocol.md).
constexpr uint16_t kHandshakeRevisionPlain = 1;
constexpr uint16_t kHandshakeRevisionMetadata = 2;
constexpr uint16_t kHandshakeRevision = kHandshakeRevisionMetadata;  // what this build speaks
// A revision field as sent: 0 (engines before revisions existed) means 1.
constexpr uint16_t effective_revision(uint16_t field) {
  return field == 0 ? kHandshakeRevisionPlain : field;
}
// Largest engine metadata a handshake carries (EngineMetadata's own limit).
constexpr uint32_t kMaxHelloMetadata = 64 * 1024;

struct Hello {
  uint32_t magic;
  uint16_t protocol_version;
  uint16_t stream_index;
  uint64_t engine_id;
  uint64_t group_nonce;  // same for all streams of one connection group
  uint16_t stream_count;
  uint16_t handshake_revision;  // highest the connecting side speaks (0: 1)
  uint32_t metadata_bytes;      // revision 2: its metadata, sent after the reply
};
static_assert(sizeof(Hello) == 32);

struct HelloReply {
  uint32_t magic;
  uint16_t protocol_version;
  uint16_t status;  // StatusCode; non-zero: refused, message follows
  uint64_t engine_id;
  // Bytes that follow: the refusal's message, or (status 0, revision 2, a
  // Hello with metadata) the accepting engine's metadata.
  uint32_t message_bytes;
  uint16_t handshake_revision;  // agreed: min of both sides (0 from engines before: 1)
  uint16_t reserved;
};
static_assert(sizeof(HelloReply) == 24);
constexpr uint32_t kMaxHelloMessage = 1024;

enum class Op : uint8_t {
  kWrite = 1,         // request: segments in aux, payload follows
  kWriteAck = 2,      // response: status (+ message in aux)
  kReadRequest = 3,   // request: segments in aux
  kReadResponse = 4,  // response: status; payload (or message in aux)
  kNotify = 5,        // request: notification bytes in aux
  kNotifyAck = 6,     // response: status
};
const char* op_name(uint8_t op);
inline bool is_request(Op op) {
  return op == Op::kWrite || op == Op::kReadRequest || op == Op::kNotify;
}

// FrameHeader.flags. Frames of untraced transfers carry 0, as in version 1
// before these bits existed (receivers of that version ignore flags).
// kFlagTrace on a request: answer with a stage trace trailer. On a response:
// its aux starts with a TraceTrailer (then the error message, if any). Only
// a request that asked gets one, so a peer that never asks never sees it.
constexpr uint8_t kFlagTrace = 0x01;

struct FrameHeader {
  uint16_t magic;
  uint8_t op;
  uint8_t flags;   // kFlag*
  uint32_t count;  // segments in aux (WRITE, READ_REQUEST)
  uint64_t transfer_id;
  uint64_t payload_bytes;
  uint32_t aux_bytes;
  uint32_t status;  // StatusCode, responses only
};
static_assert(sizeof(FrameHeader) == 32);

struct WireSegment {
  uint64_t region_id;
  uint64_t adv_offset;
  uint64_t adv_length;
  uint64_t key;
  uint64_t offset;  // relative to the advertised start
  uint64_t length;
  uint8_t access;
  uint8_t reserved[7];
};
static_assert(sizeof(WireSegment) == 56);

// The target's stage timestamps for one request frame (CLOCK_MONOTONIC ns,
// 0: did not occur), in the order of TraceStage from kFrameReceived on:
// frame_received, payload_received, target_copy_submitted, target_copy_done,
// response_sent. A receiver reads the entries it knows and skips the rest.
struct TraceTrailerHead {
  uint32_t stages;  // int64 entries that follow, 1..kMaxTraceTrailerStages
  uint32_t reserved;
};
static_assert(sizeof(TraceTrailerHead) == 8);
constexpr uint32_t kTraceTrailerStages = 5;  // what this version sends
constexpr uint32_t kMaxTraceTrailerStages = 16;
constexpr uint32_t kMaxTraceTrailerBytes = sizeof(TraceTrailerHead) + 8 * kMaxTraceTrailerStages;

// Hard limits a receiver enforces before trusting a header.
constexpr uint32_t kMaxSegmentsPerFrame = 1024;
constexpr uint64_t kMaxFramePayload = 256ull << 20;
constexpr uint32_t kMaxNotificationBytes = 1u << 20;
constexpr uint32_t kMaxErrorMessage = 4096;

// Checks magic, opcode and the size fields of a header. Does not check the
// segment table against the payload (see check_segments).
Status validate_header(const FrameHeader& h);
// Checks a WRITE / READ_REQUEST segment table: sizes add up without overflow
// to the header's payload_bytes (WRITE) or to at most kMaxFramePayload.
// The size of the trace trailer at the start of a response's aux (0 when
// the header is not flagged kFlagTrace); ProtocolError if it does not fit.
Result<size_t> trace_trailer_size(const FrameHeader& h, std::span<const uint8_t> aux);

Status check_segments(const FrameHeader& h, std::span<const WireSegment> segments,
                      uint64_t* total_bytes);

}  // namespace ferry::tcp
