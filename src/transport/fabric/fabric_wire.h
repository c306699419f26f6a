// Control messages of the fabric transport: untagged fi_send/fi_recv on the
// same RDM endpoint that carries the RMA. Every message is a fixed 32-byte
// header and a body; every field is untrusted and bounds-checked on decode.
//
//   header: u32 magic "FRYF", u8 version, u8 type, u16 0, u64 sender engine
//           id, u64 request id, u32 body bytes, u32 0 (little endian)
//
// docs/fabric.md lists the messages and what each side checks.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry::fabric {

constexpr uint32_t kMagic = 0x46595246;  // "FRYF"
constexpr uint8_t kWireVersion = 1;
constexpr size_t kHeaderBytes = 32;
constexpr uint32_t kMaxNotificationBytes = 1u << 20;
constexpr uint32_t kMaxAddressBytes = 4096;
constexpr uint32_t kMaxTextBytes = 4096;
// Largest body any message may have (a notification plus its length).
constexpr uint32_t kMaxBodyBytes = kMaxNotificationBytes + 64;
constexpr size_t kMaxMessageBytes = kHeaderBytes + kMaxBodyBytes;

enum class MsgType : uint8_t {
  kHello = 1,     // initiator → target: protocol version, expected id, address
  kHelloAck = 2,  // status (target refuses a version it does not speak)
  kGrantReq = 3,  // descriptor fields of a region the initiator wants to use
  kGrant = 4,     // status, provider key, base address
  kRevoke = 5,    // region id: its key is closed
  kNotify = 6,    // notification payload (after all data of its write)
  kPing = 7,
  kPong = 8,
  kBye = 9,         // the sender shuts down
  kRevokeAck = 10,  // region id: no op of ours on it is in flight any more
};
const char* msg_type_name(uint8_t type);

struct Header {
  uint8_t type = 0;
  uint64_t sender = 0;
  uint64_t request = 0;
  uint32_t body_bytes = 0;
};

struct Hello {
  uint16_t protocol = 0;
  uint64_t expected = 0;  // the engine id the sender meant to reach (0: any)
  std::string provider;
  Bytes address;  // fi_getname bytes of the sender's endpoint
  // Optional (absent from older senders): kHelloHmem -- the sender registers
  // GPU memory with FI_HMEM, so its GPU memory can be reached one-sided.
  uint16_t flags = 0;
};
constexpr uint16_t kHelloHmem = 1;

struct HelloAck {
  Status status;
};

struct GrantReq {
  uint64_t region = 0;
  uint64_t adv_offset = 0;
  uint64_t adv_length = 0;
  uint64_t key = 0;
  uint8_t access = 0;
};

struct Grant {
  Status status;
  uint64_t mr_key = 0;
  // Remote address of the advertised range's byte 0 is base + adv_offset
  // (base = the region's virtual address under FI_MR_VIRT_ADDR, else 0).
  uint64_t base = 0;
};

Bytes encode(MsgType type, uint64_t sender, uint64_t request, const Bytes& body);
// Checks the header against the bytes received; `len` is what fi_recv got.
Result<Header> decode_header(const uint8_t* data, size_t len);

Bytes encode_hello(const Hello& h);
Result<Hello> decode_hello(ByteView body);
Bytes encode_status(const Status& s);
// Decodes a status into *out; the return value is a ProtocolError when malformed.
Status decode_status(ByteView body, Status* out, size_t* used = nullptr);
Bytes encode_grant_req(const GrantReq& g);
Result<GrantReq> decode_grant_req(ByteView body);
Bytes encode_grant(const Grant& g);
Result<Grant> decode_grant(ByteView body);
Bytes encode_u64(uint64_t v);
Result<uint64_t> decode_u64(ByteView body, const char* what);

}  // namespace ferry::fabric
