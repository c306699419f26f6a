// The shm transport's wire format: control messages on a Unix stream socket.
// Data never travels on it. In cross-memory attach mode the target process
// copies the bytes itself with process_vm_readv/writev (cma.h), so a frame
// names the initiator's addresses; in staging mode (staging.h) a frame names
// offsets in the initiator's shared-memory staging area instead.
//
// Every frame is a 16-byte header followed by `body_bytes` of body:
//
//   header  u32 magic "FSHM" | u16 version | u8 op | u8 flags | u32 body_bytes | u32 reserved (0)
//           flags: kFlagNotification on a WRITE_REQ that carries its write's notification
//           (delivered after the copy); kFlagStaged on a WRITE_REQ or READ_REQ whose segment
//           addresses are offsets in the initiator's staging area; 0 otherwise
//   HELLO       u64 engine id | u64 expected engine id (0: any) | u64 probe address |
//               u32 probe length (8) | u8 mode | u8[3] reserved | u64 probe value (40 bytes)
//   HELLO_ACK   u16 status | u8 mode | u8 flags | u32 message length | u64 engine id |
//               u64 probe address | u32 probe length | u32 features | u64 probe value |
//               u64 staging bytes | message                                 (48 bytes + message)
//     features  kFeatureGpuAreas: the acceptor keeps both staging areas in cross-memory
//               attach mode too, to stage GPU memory (the connecting engine then sends its
//               area on a cma HELLO_DONE); other bits 0. Older engines wrote 0 here and
//               ignore the field, so neither side sends what the other cannot read.
//   HELLO_DONE  u16 status | u8 chosen mode | u8 flags | u32 message length |
//               u64 staging bytes | message                                 (16 bytes + message)
//     mode      0 auto, 1 cma, 2 staging: the sender's shm.mode (HELLO, HELLO_ACK) or the
//               connection's (HELLO_DONE: 1 or 2; 1 with an area only after kFeatureGpuAreas)
//     flags     kHandshakeCmaRefused: status is Ok but the sender's probe of the peer failed;
//               the message says why (the connection then runs in staging mode)
//               kHandshakeArea: the sender's staging memfd rides on this frame (SCM_RIGHTS)
//               and `staging bytes` is its size; 0 without one
//   WRITE_REQ, READ_REQ, NOTIFY_REQ
//               u64 request id | u32 segment count | u32 notification length |
//               segment[count] | notification bytes
//     segment   u64 region id | u64 advertised offset | u64 advertised length | u64 key |
//               u64 offset | u64 length | u64 initiator address (staged: area offset) |
//               u8 access | u8[7] reserved                                    (64 bytes each)
//   RESPONSE    u64 request id | u16 status | u16 reserved | u32 message length | message
//   RING        u64 ring bytes; the sender's request ring (a sealed memfd) rides along
//               (SCM_RIGHTS). Sent once by each side right after a handshake that chose
//               request rings (kFeatureRequestRing, kHandshakeRing), before any request.
//   RING_WAKE   no body: the sender put requests (or answers) in a ring while the receiver
//               was not polling it (shm_request_ring.h)
//
// All integers are little endian. A receiver checks every length before it
// trusts it: the header's body_bytes against the op's limit, then the body's
// fields against body_bytes exactly. Anything else is a ProtocolError.
#pragma once

#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/region_registry.h"
#include "ferry/status.h"
#include "ferry/types.h"
#include "transport/common/unix_socket.h"
#include "transport/common/wire_codec.h"

namespace ferry::shm {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little endian; add byte swapping for this host");

constexpr uint32_t kFrameMagic = 0x4D485346;  // "FSHM"
constexpr uint16_t kWireVersion = 2;          // 2: staging mode
constexpr size_t kFrameHeaderBytes = wire_codec::kFrameHeaderBytes;
constexpr size_t kSegmentBytes =  // 64
    wire_codec::kRemoteRangeBytes + 8 + wire_codec::kAccessTailBytes;
constexpr size_t kRequestFixedBytes = 16;
constexpr size_t kResponseFixedBytes = 16;
constexpr size_t kHelloBytes = 40;
constexpr size_t kHelloAckFixedBytes = 48;
constexpr size_t kHelloDoneFixedBytes = 16;

// Hard limits a receiver enforces before trusting a header.
constexpr uint32_t kMaxRequestSegments = 1024;  // IOV_MAX: one syscall per request
constexpr uint32_t kMaxNotificationBytes = 1u << 20;
constexpr uint32_t kMaxMessageBytes = 4096;  // error text in responses and handshakes
// Handshake frames may grow in later versions; this bound lets a receiver
// read a newer peer's HELLO whole and answer it with a version error.
constexpr uint32_t kMaxHandshakeBody = 8192;
constexpr uint32_t kProbeBytes = 8;

enum class Op : uint8_t {
  kHello = 1,
  kHelloAck = 2,
  kHelloDone = 3,
  kWriteReq = 4,   // the target pulls the initiator's bytes into its region
  kReadReq = 5,    // the target pushes its region's bytes to the initiator
  kNotifyReq = 6,  // notification only (no segments)
  kResponse = 7,
  kCancel = 8,     // the initiator gave up on these requests: skip those not yet served
  kRing = 9,       // the sender's request ring (its memfd rides along): shm_request_ring.h
  kRingWake = 10,  // empty: the sender put requests or answers in a ring nobody polls
};
const char* op_name(Op op);
inline bool is_request(Op op) {
  return op == Op::kWriteReq || op == Op::kReadReq || op == Op::kNotifyReq;
}

constexpr uint8_t kFlagNotification = 1;
constexpr uint8_t kFlagStaged = 2;

// How a connection moves bytes: shm.mode's values, and the handshake's.
enum class Mode : uint8_t {
  kAuto = 0,     // cross-memory attach if both probes succeed, else staging
  kCma = 1,      // cross-memory attach only
  kStaging = 2,  // shared-memory staging only
};
const char* mode_name(Mode mode);

constexpr uint8_t kHandshakeCmaRefused = 1;
constexpr uint8_t kHandshakeArea = 2;

// HELLO_ACK features.
constexpr uint32_t kFeatureGpuAreas = 1;
// The acceptor takes small requests through shared-memory request rings
// (shm.request_ring): the connecting engine may answer with kHandshakeRing.
constexpr uint32_t kFeatureRequestRing = 2;
// HELLO_DONE flag: request rings on this connection (only after
// kFeatureRequestRing): each side sends a RING frame right after the
// handshake, before any request.
constexpr uint8_t kHandshakeRing = 4;

struct FrameHeader {
  uint16_t version = kWireVersion;
  Op op = Op::kResponse;
  uint8_t flags = 0;
  uint32_t body_bytes = 0;
};

// The largest body a header of `op` may announce.
uint64_t max_body_bytes(Op op);
// Checks magic, opcode, flags and body_bytes against the op's limit. The
// version is checked here for data frames; handshake frames carry it to the
// handshake code, which answers a mismatch naming both versions.
Result<FrameHeader> decode_header(ByteView bytes);

// One segment of a request: what the target must check, and where the
// initiator's side of the bytes lies: an address in the initiator's address
// space, or (staged requests) an offset in its staging area.
struct WireSegment {
  RemoteAccessRequest remote;
  uint64_t address = 0;
};

struct Request {
  Op op = Op::kWriteReq;
  uint64_t id = 0;
  std::vector<WireSegment> segments;
  bool staged = false;  // kFlagStaged: addresses are staging area offsets
  // NOTIFY_REQ always, WRITE_REQ with kFlagNotification: deliver after the
  // copy (the payload may be empty).
  bool has_notification = false;
  Bytes notification;
  // Set by a CANCEL that arrived while the request waited for a copy worker.
  bool cancelled = false;

  uint64_t total_bytes() const {
    uint64_t n = 0;
    for (const WireSegment& s : segments) n += s.remote.length;
    return n;
  }
};

// CANCEL body: u32 count, u32 reserved 0, count × u64 request id.
constexpr uint32_t kMaxCancelIds = 1 << 16;
Bytes encode_cancel(std::span<const uint64_t> ids);
Result<std::vector<uint64_t>> decode_cancel(ByteView body);

struct Response {
  uint64_t id = 0;
  Status status;
};

struct Hello {
  uint64_t engine_id = 0;
  uint64_t expected_engine_id = 0;
  uint64_t probe_address = 0;
  uint32_t probe_length = kProbeBytes;
  Mode mode = Mode::kAuto;
  uint64_t probe_value = 0;
};

struct HelloAck {
  Status status;
  Mode mode = Mode::kAuto;
  uint64_t engine_id = 0;
  uint64_t probe_address = 0;
  uint32_t probe_length = kProbeBytes;
  uint64_t probe_value = 0;
  // Status Ok but the acceptor's probe of the connecting engine failed: why.
  std::string cma_refusal;
  uint64_t staging_bytes = 0;  // > 0: the acceptor's staging area rides along
  uint32_t features = 0;       // kFeatureGpuAreas
};

struct HelloDone {
  Status status;
  Mode mode = Mode::kCma;      // the connection's: kCma or kStaging (status Ok)
  std::string cma_refusal;     // the connecting engine's probe failed: why
  uint64_t staging_bytes = 0;  // > 0: the connecting engine's staging area rides along
  bool request_ring = false;   // kHandshakeRing
};

// Encoders return whole frames (header + body), ready to send.
// `has_notification` applies to WRITE_REQ (NOTIFY_REQ always has one,
// READ_REQ never); `staged` to WRITE_REQ and READ_REQ.
Bytes encode_request(Op op, uint64_t id, std::span<const WireSegment> segments,
                     bool has_notification, ByteView notification, bool staged = false);
Bytes encode_response(uint64_t id, const Status& status);
Bytes encode_hello(const Hello& hello);
Bytes encode_hello_ack(const HelloAck& ack);
Bytes encode_hello_done(const HelloDone& done);

// RING body: u64 ring bytes (the memfd rides along); RING_WAKE: no body.
constexpr size_t kRingBodyBytes = 8;
Bytes encode_ring(uint64_t ring_bytes);
Result<uint64_t> decode_ring(ByteView body);
Bytes encode_ring_wake();

// Decoders take the body of a frame whose header decode_header accepted.
Result<Request> decode_request(const FrameHeader& header, ByteView body);
Result<Response> decode_response(ByteView body);
Result<Hello> decode_hello(ByteView body);
Result<HelloAck> decode_hello_ack(ByteView body);
Result<HelloDone> decode_hello_done(ByteView body);

// The transport's address in engine metadata: where the listener is, and the
// pid for messages only (the connection's real pid comes from SO_PEERCRED).
//   u8 format (1) | u8 reserved | u16 path length | u32 pid | path bytes
struct ShmAddress {
  std::string socket_path;
  uint32_t pid = 0;
};
constexpr uint8_t kAddressFormat = 1;
constexpr size_t kMaxSocketPath = unix_socket::kMaxPath;
Bytes encode_address(const ShmAddress& address);
Result<ShmAddress> decode_address(ByteView bytes);

}  // namespace ferry::shm
