#include "transport/shm/shm_request_ring.h"

#include <cstring>

#include "fmt/format.h"

namespace ferry::shm {

namespace {
constexpr uint64_t kSequenceAt = 8;
constexpr uint64_t kRequestLengthAt = 16;
constexpr uint64_t kAnswerLengthAt = 20;

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
}  // namespace

Result<RequestRing> RequestRing::create(const std::string& name) {
  auto area = StagingArea::create(kRingBytes, name);
  if (!area.ok()) return area.status();
  RequestRing ring(std::move(area.value()));
  uint8_t* h = ring.area_.data();
  const uint32_t head[4] = {kRingMagic, kRingLayout, kRingSlots,
                            static_cast<uint32_t>(kRingSlotBytes)};
  std::memcpy(h, head, sizeof head);
  return ring;
}

Result<RequestRing> RequestRing::adopt(int fd, uint64_t announced) {
  if (announced != kRingBytes) {
    ::close(fd);
    return err::ProtocolError(
        fmt::format("shm: the peer's request ring is {} bytes, this engine's layout {} has {}",
                    announced, kRingLayout, kRingBytes));
  }
  auto area = StagingArea::adopt(fd, announced);
  if (!area.ok()) {
    return Status(area.status().code(), fmt::format("request ring: {}", area.status().message()));
  }
  return RequestRing(std::move(area.value()));
}

void RequestRing::post(uint32_t slot, uint64_t sequence, ByteView frame) const {
  post_claiming(slot, sequence, frame, static_cast<uint32_t>(frame.size()));
}

void RequestRing::post_claiming(uint32_t slot, uint64_t sequence, ByteView frame,
                                uint32_t length) const {
  uint8_t* s = area_.data() + slot_at(slot);
  std::memcpy(s + kSequenceAt, &sequence, sizeof sequence);
  std::memcpy(s + kRequestLengthAt, &length, sizeof length);
  std::memcpy(s + kRingSlotControlBytes, frame.data(), frame.size());
  state(slot).store(static_cast<uint32_t>(SlotState::kPosted), std::memory_order_seq_cst);
}

Result<std::optional<Request>> RequestRing::take_request(uint64_t sequence) const {
  const uint32_t slot = ring_slot(sequence);
  const uint32_t st = state(slot).load(std::memory_order_seq_cst);
  // FREE (not posted yet), ANSWERED or HARVESTING (the previous round of this
  // slot, not reused yet): nothing new.
  if (st != static_cast<uint32_t>(SlotState::kPosted)) {
    if (st > static_cast<uint32_t>(SlotState::kHarvesting)) {
      return err::ProtocolError(
          fmt::format("request ring slot {} is in state {}, which does not exist", slot, st));
    }
    return std::optional<Request>();
  }
  const uint8_t* s = area_.data() + slot_at(slot);
  const uint64_t posted = load_u64(s + kSequenceAt);
  if (posted != sequence) {
    // The slot's previous round, still marked posted after its answer? No:
    // the target wrote ANSWERED itself. Anything else is the peer's error.
    return err::ProtocolError(fmt::format(
        "request ring slot {} holds request sequence {}, expected {}", slot, posted, sequence));
  }
  const uint32_t length = load_u32(s + kRequestLengthAt);
  if (length < kFrameHeaderBytes || length > kRingRequestBytes) {
    return err::ProtocolError(fmt::format(
        "request ring slot {} (sequence {}) announces a request of {} bytes (allowed {} to {})",
        slot, sequence, length, kFrameHeaderBytes, kRingRequestBytes));
  }
  // Copied out before anything is checked: the peer may rewrite the slot
  // while we decode.
  Bytes frame(s + kRingSlotControlBytes, s + kRingSlotControlBytes + length);
  auto request = decode_ring_request(frame, slot);
  if (!request.ok()) return request.status();
  return std::optional<Request>(std::move(request.value()));
}

Result<Request> decode_ring_request(ByteView frame, uint32_t slot) {
  auto fail = [slot](const std::string& why) {
    return err::ProtocolError(fmt::format("request ring slot {}: {}", slot, why));
  };
  if (frame.size() < kFrameHeaderBytes) {
    return fail(fmt::format("a frame of {} bytes", frame.size()));
  }
  auto h = decode_header(frame.first(kFrameHeaderBytes));
  if (!h.ok()) return fail(h.status().message());
  if (!is_request(h->op)) return fail(fmt::format("holds a {}, not a request", op_name(h->op)));
  if (h->version != kWireVersion) {
    return fail(fmt::format("wire version {}, expected {}", h->version, kWireVersion));
  }
  if (kFrameHeaderBytes + uint64_t{h->body_bytes} != frame.size()) {
    return fail(fmt::format("a {}-byte body in a frame of {} bytes", h->body_bytes, frame.size()));
  }
  auto request = decode_request(*h, frame.subspan(kFrameHeaderBytes));
  if (!request.ok()) return fail(request.status().message());
  return request;
}

void RequestRing::answer(uint32_t slot, ByteView frame) const {
  uint8_t* s = area_.data() + slot_at(slot);
  const auto length = static_cast<uint32_t>(frame.size());
  std::memcpy(s + kAnswerLengthAt, &length, sizeof length);
  std::memcpy(s + kRingSlotControlBytes + kRingRequestBytes, frame.data(), frame.size());
  state(slot).store(static_cast<uint32_t>(SlotState::kAnswered), std::memory_order_seq_cst);
}

Result<Response> RequestRing::take_answer(uint32_t slot) const {
  const uint8_t* s = area_.data() + slot_at(slot);
  const uint32_t length = load_u32(s + kAnswerLengthAt);
  if (length < kFrameHeaderBytes || length > kRingAnswerBytes) {
    return err::ProtocolError(
        fmt::format("request ring slot {}: an answer of {} bytes (allowed {} to {})", slot, length,
                    kFrameHeaderBytes, kRingAnswerBytes));
  }
  const uint8_t* at = s + kRingSlotControlBytes + kRingRequestBytes;
  Bytes frame(at, at + length);
  return decode_ring_answer(frame, slot);
}

Result<Response> decode_ring_answer(ByteView frame, uint32_t slot) {
  auto fail = [slot](const std::string& why) {
    return err::ProtocolError(fmt::format("request ring slot {}: answer {}", slot, why));
  };
  if (frame.size() < kFrameHeaderBytes) return fail(fmt::format("of {} bytes", frame.size()));
  auto h = decode_header(frame.first(kFrameHeaderBytes));
  if (!h.ok()) return fail(h.status().message());
  if (h->op != Op::kResponse) return fail(fmt::format("is a {}, not a RESPONSE", op_name(h->op)));
  if (kFrameHeaderBytes + uint64_t{h->body_bytes} != frame.size()) {
    return fail(fmt::format("with a {}-byte body in {} bytes", h->body_bytes, frame.size()));
  }
  auto response = decode_response(frame.subspan(kFrameHeaderBytes));
  if (!response.ok()) return fail(response.status().message());
  return response;
}

}  // namespace ferry::shm
