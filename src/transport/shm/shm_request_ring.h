// The shm transport's request rings: small requests and their answers in
// shared memory instead of socket frames (shm.request_ring).
//
// Each side of a connection creates one ring (a sealed memfd, like a staging
// area) for the requests it initiates and hands it to the peer at the
// handshake. The initiator writes a request -- the very frame it would have
// sent on the socket, encoded by shm_wire.h -- into a slot and marks it
// POSTED; the target copies the frame out of the slot, decodes it with the
// socket's decoder and serves it exactly like a socket request (the same
// checks of key, range, access and revocation, the same copy), then writes
// the RESPONSE frame into the slot and marks it ANSWERED. The initiator's
// thread waiting on the transfer sees that without a system call.
//
// Slots are used in order (slot = sequence % kRingSlots) and the target
// serves them in that order, so the requests of one ring are served as they
// were posted. Nobody spins while idle: the target polls rings only while its
// I/O thread busy-polls (shm.busy_poll_us, flag `target_polling`); an
// initiator that finds the flag down sends a RING_WAKE frame on the socket.
// The answer side is the mirror: while a thread of the initiator polls
// (`initiator_lease_ns` lies in the future) the target writes answers
// silently; otherwise it sends RING_WAKE so that the initiator's I/O thread
// reads them.
//
// Layout (little endian; the initiator writes everything but a slot's answer
// and `target_polling`):
//   header    kRingHeaderBytes: u32 magic "FRNG" | u32 layout | u32 slots | u32 slot bytes,
//             at 64 u32 target_polling (target), at 128 u64 initiator_lease_ns (initiator,
//             CLOCK_MONOTONIC), at 192 u32 target_woken, at 256 u32 initiator_woken
//   slot[i]   at kRingHeaderBytes + i * kRingSlotBytes:
//             0 u32 state (FREE, POSTED, ANSWERED; HARVESTING: the initiator reads the
//             answer) | 8 u64 sequence | 16 u32 request bytes | 20 u32 answer bytes |
//             64 request frame (at most kRingRequestBytes) | 64 + kRingRequestBytes answer
//             frame (at most kRingAnswerBytes)
//
// The target trusts nothing in the ring: it copies a slot's frame into its
// own memory before decoding (the peer may rewrite the slot meanwhile), checks
// every length against the slot, and a slot that does not hold a well-formed
// request of the expected sequence closes the connection with an error naming
// the slot. The initiator checks answers the same way.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include "ferry/status.h"
#include "transport/shm/shm_wire.h"
#include "transport/shm/staging.h"

namespace ferry::shm {

constexpr uint32_t kRingMagic = 0x474E5246;  // "FRNG"
constexpr uint32_t kRingLayout = 1;
constexpr uint32_t kRingSlots = 128;
constexpr uint64_t kRingHeaderBytes = 4096;
constexpr uint64_t kRingSlotBytes = 16384;
constexpr uint64_t kRingSlotControlBytes = 64;
constexpr uint64_t kRingRequestBytes = 8192;
constexpr uint64_t kRingAnswerBytes = kRingSlotBytes - kRingSlotControlBytes - kRingRequestBytes;
constexpr uint64_t kRingBytes = kRingHeaderBytes + uint64_t{kRingSlots} * kRingSlotBytes;
static_assert(kRingBytes >= kMinStagingBytes);
static_assert(kRingAnswerBytes >= kFrameHeaderBytes + kResponseFixedBytes + kMaxMessageBytes);

enum class SlotState : uint32_t {
  kFree = 0,
  kPosted = 1,
  kAnswered = 2,
  kHarvesting = 3,
};

// A mapped ring: accessors for the shared words and the slots' frames.
// Every atomic word is naturally aligned in the page-aligned mapping.
class RequestRing {
 public:
  RequestRing() = default;
  explicit RequestRing(StagingArea area) : area_(std::move(area)) {}

  // A new ring, its header written.
  static Result<RequestRing> create(const std::string& name);
  // The peer's ring: a sealed memfd of exactly kRingBytes (adopt checks).
  static Result<RequestRing> adopt(int fd, uint64_t announced);

  bool valid() const { return area_.valid(); }
  int fd() const { return area_.fd(); }
  void close_fd() { area_.close_fd(); }

  std::atomic_ref<uint32_t> target_polling() const { return word32(64); }
  std::atomic_ref<uint64_t> initiator_lease_ns() const { return word64(128); }
  // A RING_WAKE is on its way to the target (set by the initiator, cleared
  // by the target before it serves), and one to the initiator (set by the
  // target, cleared by the initiator before it reads answers): one frame
  // wakes for many requests or answers.
  std::atomic_ref<uint32_t> target_woken() const { return word32(192); }
  std::atomic_ref<uint32_t> initiator_woken() const { return word32(256); }
  std::atomic_ref<uint32_t> state(uint32_t slot) const { return word32(slot_at(slot)); }

  // Initiator: writes `frame` (at most kRingRequestBytes) with `sequence`
  // into `slot`, then marks it POSTED (seq_cst: ordered before the read of
  // target_polling that decides whether to wake the target).
  void post(uint32_t slot, uint64_t sequence, ByteView frame) const;
  // The same with `length` in the slot's request-length word (tests of a
  // target facing a peer that lies about it).
  void post_claiming(uint32_t slot, uint64_t sequence, ByteView frame, uint32_t length) const;
  // Target: the request in the slot of `sequence`, copied out and decoded;
  // nothing while that slot holds no posted request; a ProtocolError naming
  // the slot when it holds anything else.
  Result<std::optional<Request>> take_request(uint64_t sequence) const;
  // Target: writes a RESPONSE frame into `slot` and marks it ANSWERED.
  void answer(uint32_t slot, ByteView frame) const;
  // Initiator: the answer in `slot` (which it moved to HARVESTING), copied
  // out and decoded.
  Result<Response> take_answer(uint32_t slot) const;

 private:
  uint64_t slot_at(uint32_t slot) const {
    return kRingHeaderBytes + uint64_t{slot} * kRingSlotBytes;
  }
  std::atomic_ref<uint32_t> word32(uint64_t at) const {
    return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(area_.data() + at));
  }
  std::atomic_ref<uint64_t> word64(uint64_t at) const {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(area_.data() + at));
  }

  StagingArea area_;
};

// The slot of a sequence number.
inline uint32_t ring_slot(uint64_t sequence) {
  return static_cast<uint32_t>(sequence % kRingSlots);
}

// Decodes a request frame copied out of slot `slot` (also what fuzzing feeds).
Result<Request> decode_ring_request(ByteView frame, uint32_t slot);
// Decodes an answer frame copied out of slot `slot`.
Result<Response> decode_ring_answer(ByteView frame, uint32_t slot);

}  // namespace ferry::shm
