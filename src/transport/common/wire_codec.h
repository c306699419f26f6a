// What the control-message codecs of the shm, cuda_ipc and fabric transports
// share: a status (code and message) in a body, the check that a body ends
// where its fields do, and the 16-byte frame header of the Unix-socket
// transports (shm, cuda_ipc):
//
//   u32 magic | u16 version | u8 op | u8 flags | u32 body_bytes | u32 reserved (0)
//
// All integers are little endian. Every error is a ProtocolError whose text
// starts with the transport's prefix and names the frame or field at fault.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/byte_codec.h"
#include "core/region_registry.h"
#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry::wire_codec {

// One transport's codec settings.
struct Codec {
  // Starts every error text: "cuda_ipc: ", "fabric: ", or "" where the
  // transport puts its own context around the message (shm).
  std::string_view error_prefix;
  // The longest status message that travels; longer ones are clipped.
  uint32_t max_message_bytes = 0;
};

// ---------------------------------------------------------------- status ---

// The part of `message` that travels.
std::string_view clipped(const Codec& codec, const std::string& message);
// A status code read off the wire; one this build does not know is an error
// "<what> with unknown status code N".
Result<StatusCode> status_code(const Codec& codec, uint32_t code, std::string_view what);

// A status as shm and cuda_ipc send it: u16 code | u16 0 | u32 message length
// (put_status_head), then the message bytes (put_message) where the body
// format puts them, last.
void put_status_head(const Codec& codec, ByteWriter& w, const Status& s);
void put_message(const Codec& codec, ByteWriter& w, const Status& s);
// Reads the head put_status_head wrote. A set reserved u16 is an error
// ("<what> has reserved bytes set"); a short body is left to the caller's
// check of `r` (the head is often followed by more fixed fields).
Status take_status_head(const Codec& codec, ByteReader& r, std::string_view what, uint16_t* code,
                        uint32_t* length);
// Reads the message of a status whose code and length were read: exactly
// `length` bytes must be left in the body.
Status take_status(const Codec& codec, ByteReader& r, uint16_t code, uint32_t length,
                   std::string_view what, Status* out);

// ------------------------------------------------------------------ body ---

// The body must end exactly where `r` stands: "truncated <what>", or "<what>
// has N unexpected trailing bytes".
Status expect_end(const Codec& codec, const ByteReader& r, std::string_view what);

// ------------------------------------------------------ remote segments ---

// The target-checked part of one segment, as shm's requests and cuda_ipc's
// COPY_REQ carry it (48 bytes), each transport's own fields following it:
//   u64 region id | u64 advertised offset | u64 advertised length | u64 key |
//   u64 offset | u64 length
constexpr size_t kRemoteRangeBytes = 48;
void put_remote_range(ByteWriter& w, const RemoteAccessRequest& q);
void take_remote_range(ByteReader& r, RemoteAccessRequest* q);
// The segment's end: u8 access | u8[7] 0. False if a reserved byte is set.
constexpr size_t kAccessTailBytes = 8;
void put_access_tail(ByteWriter& w, uint8_t access);
[[nodiscard]] bool take_access_tail(ByteReader& r, uint8_t* access);

// ---------------------------------------------------------- frame header ---

constexpr size_t kFrameHeaderBytes = 16;

// What a header check needs to know about one opcode.
struct OpRules {
  const char* name = "UNKNOWN";
  uint64_t max_body_bytes = 0;
  uint8_t allowed_flags = 0;
  // Handshake frames pass any version on to the handshake code, which
  // answers a mismatch naming both versions.
  bool handshake = false;
};

struct FrameFormat {
  Codec codec;
  uint32_t magic = 0;
  uint16_t version = 0;
  uint8_t first_op = 0;  // opcodes are first_op..last_op
  uint8_t last_op = 0;
  OpRules (*rules)(uint8_t op) = nullptr;
};

struct FrameHeader {
  uint16_t version = 0;
  uint8_t op = 0;
  uint8_t flags = 0;
  uint32_t body_bytes = 0;
};

// A whole frame: header + body.
Bytes frame(const FrameFormat& format, uint8_t op, const Bytes& body, uint8_t flags = 0);
// Checks magic, opcode, version (not on handshake frames), flags, reserved
// and body_bytes against the op's limit.
Result<FrameHeader> decode_header(const FrameFormat& format, ByteView bytes);

}  // namespace ferry::wire_codec
