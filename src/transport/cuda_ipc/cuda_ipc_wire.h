// The cuda_ipc transport's control messages, on a Unix stream socket. Data
// never travels on it: the initiator copies straight into (or out of) the
// peer's GPU memory, which it has mapped with the handles granted here; or,
// for local GPU memory with peer host memory, the initiator exports its GPU
// allocation (PUSH_EXPORT) and the target copies (COPY_REQ / COPY_RESP).
//
// Every frame is a 16-byte header followed by `body_bytes` of body:
//
//   header  u32 magic "FCIP" | u16 version | u8 op | u8 flags (0) | u32 body_bytes | u32 0
//   HELLO       u64 engine id | u64 expected engine id (0: any)                      (16 bytes)
//   HELLO_ACK   u16 status | u16 0 | u32 message length | u64 engine id | message
//   GRANT_REQ   u64 request id | u64 region id | u64 advertised offset |
//               u64 advertised length | u64 key | u8 access | u8[7] 0                 (48 bytes)
//   GRANT       u64 request id | u16 status | u16 0 | u32 message length |
//               (status Ok:) u8 handle kind | u8[3] 0 | u32 piece count | u8[16] GPU uuid |
//                            u64 buffer id | u64 region address | u64 span base |
//                            u64 span length | piece[count] |
//               message
//     piece     u64 offset in span | u64 length | u8[64] legacy IPC handle (zero for VMM)
//   FDS         u32 count | u32 0; the frame's first byte carries `count` descriptors
//               (SCM_RIGHTS): the VMM pieces of the next GRANT, in order
//   REVOKE      u32 count | u32 0 | count × u64 region id
//   REVOKE_ACK  u32 count | u32 0 | count × u64 region id
//   NOTIFY      u32 length | u32 0 | payload
//   PUSH_EXPORT u64 export id | grant body (as GRANT's status-Ok part, no status):
//               u8 handle kind | u8[3] 0 | u32 piece count | u8[16] GPU uuid |
//               u64 buffer id | u64 region address | u64 span base | u64 span length |
//               piece[count]; VMM descriptors come in FDS frames before it
//   COPY_REQ    u64 request id | u8 direction (1 write into the target, 2 read) |
//               u8 flags (bit 0: notification follows) | u16 0 | u32 segment count |
//               u32 notification length | u32 0 | segment[count] | notification
//     segment   u64 region id | u64 advertised offset | u64 advertised length | u64 key |
//               u64 offset (from the advertised start) | u64 length | u64 export id |
//               u64 offset in the export's span | u8 access | u8[7] 0              (72 bytes)
//   COPY_RESP   u64 request id | u16 status | u16 0 | u32 message length | message
//
// All integers are little endian. A receiver checks every length before it
// trusts it; anything else is a ProtocolError and the connection is closed.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/region_registry.h"
#include "ferry/status.h"
#include "ferry/types.h"
#include "transport/common/wire_codec.h"

namespace ferry::cuda_ipc {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little endian; add byte swapping for this host");

constexpr uint32_t kFrameMagic = 0x50494346;  // "FCIP"
// 2: PUSH_EXPORT, COPY_REQ, COPY_RESP (local GPU with peer host memory).
constexpr uint16_t kWireVersion = 2;
constexpr size_t kFrameHeaderBytes = wire_codec::kFrameHeaderBytes;
constexpr size_t kHelloBytes = 16;
constexpr size_t kGrantRequestBytes = 48;
constexpr size_t kLegacyHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
constexpr size_t kPieceBytes = 16 + kLegacyHandleBytes;
constexpr size_t kUuidBytes = 16;

constexpr uint32_t kMaxPieces = 1 << 16;  // a 128 GiB region in 2 MiB pieces
constexpr uint32_t kMaxNotificationBytes = 1u << 20;
constexpr uint32_t kMaxMessageBytes = 4096;
constexpr uint32_t kMaxRevokeIds = 1 << 16;
constexpr uint32_t kMaxFdsPerFrame = 250;
constexpr uint32_t kMaxHandshakeBody = 8192;
constexpr size_t kCopySegmentBytes =  // 72
    wire_codec::kRemoteRangeBytes + 16 + wire_codec::kAccessTailBytes;
constexpr size_t kCopyRequestHeadBytes = 24;
// A larger batch goes out as several COPY_REQs (bounds the target's parse).
constexpr uint32_t kMaxCopySegments = 4096;

enum class Op : uint8_t {
  kHello = 1,
  kHelloAck = 2,
  kGrantRequest = 3,
  kGrant = 4,
  kFds = 5,
  kRevoke = 6,
  kRevokeAck = 7,
  kNotify = 8,
  kPushExport = 9,
  kCopyRequest = 10,
  kCopyResponse = 11,
};
const char* op_name(Op op);

enum class HandleKind : uint8_t {
  kLegacy = 1,  // cudaIpcGetMemHandle of the allocation base: one piece
  kVmm = 2,     // cuMem allocations exported as POSIX file descriptors
};

struct FrameHeader {
  uint16_t version = kWireVersion;
  Op op = Op::kNotify;
  uint32_t body_bytes = 0;
};

uint64_t max_body_bytes(Op op);
// Checks magic, opcode, flags and body_bytes against the op's limit; the
// version too, except for HELLO and HELLO_ACK (the handshake answers a
// mismatch naming both versions).
Result<FrameHeader> decode_header(ByteView bytes);

struct Hello {
  uint64_t engine_id = 0;
  uint64_t expected_engine_id = 0;
};
struct HelloAck {
  Status status;
  uint64_t engine_id = 0;
};

struct GrantRequest {
  uint64_t id = 0;
  uint64_t region_id = 0;
  uint64_t adv_offset = 0;
  uint64_t adv_length = 0;
  uint64_t key = 0;
  uint8_t access = 0;
};

struct Piece {
  uint64_t offset = 0;  // from span_base
  uint64_t length = 0;
  std::array<uint8_t, kLegacyHandleBytes> handle{};
};

// What the importer needs to map a granted region: the allocations (pieces)
// that cover it, laid out from span_base in the exporter's address space, and
// where the advertised range starts there.
struct Grant {
  uint64_t request_id = 0;
  Status status;
  HandleKind kind = HandleKind::kLegacy;
  std::array<uint8_t, kUuidBytes> gpu_uuid{};
  uint64_t buffer_id = 0;
  uint64_t region_address = 0;
  uint64_t span_base = 0;
  uint64_t span_length = 0;
  std::vector<Piece> pieces;
};

// The initiator's GPU allocation shared with the target, so the target can
// copy between it and its own host memory. `grant.request_id` and
// `grant.status` are not sent.
struct PushExport {
  uint64_t export_id = 0;
  Grant grant;
};

enum class CopyDirection : uint8_t {
  kWrite = 1,  // initiator GPU -> target host (D2H on the target)
  kRead = 2,   // target host -> initiator GPU (H2D on the target)
};

struct CopySegment {
  RemoteAccessRequest remote;  // checked by the target (check_remote)
  uint64_t export_id = 0;
  uint64_t export_offset = 0;  // from the export's span base
};

struct CopyRequest {
  uint64_t id = 0;
  CopyDirection direction = CopyDirection::kWrite;
  bool has_notification = false;
  std::vector<CopySegment> segments;
  Bytes notification;
};

struct CopyResponse {
  uint64_t request_id = 0;
  Status status;
};

// Encoders return whole frames (header + body).
Bytes encode_hello(const Hello& hello);
Bytes encode_hello_ack(const HelloAck& ack);
Bytes encode_grant_request(const GrantRequest& request);
Bytes encode_grant(const Grant& grant);
Bytes encode_fds(uint32_t count);
Bytes encode_revoke(Op op, std::span<const uint64_t> region_ids);  // REVOKE or REVOKE_ACK
Bytes encode_notify(ByteView payload);
Bytes encode_push_export(const PushExport& e);
Bytes encode_copy_request(const CopyRequest& q);
Bytes encode_copy_response(const CopyResponse& r);

// Decoders take the body of a frame whose header decode_header accepted.
Result<Hello> decode_hello(ByteView body);
Result<HelloAck> decode_hello_ack(ByteView body);
Result<GrantRequest> decode_grant_request(ByteView body);
// Checks that the pieces lie inside the span, in order, without overlap, and
// that the span covers the region address.
Result<Grant> decode_grant(ByteView body);
Result<uint32_t> decode_fds(ByteView body);
Result<std::vector<uint64_t>> decode_revoke(ByteView body);
// Same checks on the pieces as decode_grant.
Result<PushExport> decode_push_export(ByteView body);
// Checks the counts against the body and the limits, direction and flags;
// a notification only on a write.
Result<CopyRequest> decode_copy_request(ByteView body);
Result<CopyResponse> decode_copy_response(ByteView body);

// Readies a connected control socket for the I/O thread: blocking for
// sends, so that SO_SNDTIMEO (unix_socket::set_send_timeout) bounds a send
// and a frame larger than the socket's buffer goes out whole. A COPY_REQ of
// kMaxCopySegments is 295 KB (with a notification up to 1.3 MB), a GRANT or
// PUSH_EXPORT of many VMM pieces more, the default Unix socket buffer 208 KiB:
// on an O_NONBLOCK socket sendmsg wrote part of such a frame, then failed with
// EAGAIN, and the next frame went out behind the half-sent one. Reads are
// unaffected: unix_socket::receive passes MSG_DONTWAIT.
Status prepare_control_socket(int fd);

// The transport's address in engine metadata. GPUs are named by UUID and PCI
// bus id, never by ordinal (a peer with another CUDA_VISIBLE_DEVICES numbers
// them differently):
//   u8 format | u8 0 | u16 path length | u32 pid | u16 GPU count | u16 0 |
//   GPU count × (u8[16] uuid [format 2: | u32 PCI bus id, packed]) | path bytes
// Format 1 (older builds) lacks the PCI bus ids; both are read.
struct Address {
  std::string socket_path;
  uint32_t pid = 0;
  std::vector<std::array<uint8_t, kUuidBytes>> gpus;
  std::vector<uint32_t> gpu_pci;  // per GPU (ferry/gpu.h pack_pci_bus_id); 0: unknown
};
constexpr uint8_t kAddressFormat = 2;
constexpr uint8_t kAddressFormatUuidOnly = 1;
constexpr uint16_t kMaxAddressGpus = 1024;
Bytes encode_address(const Address& address);
Result<Address> decode_address(ByteView bytes);
// "GPU-1a2b... (0000:18:00.0)": the address's GPU `i` for messages.
std::string gpu_text(const Address& address, size_t i);

// "GPU-1a2b3c4d-..." as nvidia-smi prints it.
std::string uuid_text(const std::array<uint8_t, kUuidBytes>& uuid);

}  // namespace ferry::cuda_ipc
