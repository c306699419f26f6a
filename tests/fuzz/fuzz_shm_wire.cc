// libFuzzer target: shm's control-socket decoders (src/transport/shm/
// shm_wire.h), the request ring's slot decoders (shm_request_ring.h) and its
// metadata address must reject or accept any bytes
// without reading out of bounds; what they accept re-encodes to a frame that
// decodes again.
#include "transport/shm/shm_request_ring.h"
#include "transport/shm/shm_wire.h"
#include "wire_fuzz_util.h"

namespace {

using namespace ferry;
using namespace ferry::shm;

// The body of a frame an encoder made (its header checked first).
ByteView body_of(const Bytes& frame) {
  auto h = decode_header(ByteView(frame));
  FERRY_FUZZ_REQUIRE(h.ok() && h->body_bytes == frame.size() - kFrameHeaderBytes);
  return ByteView(frame).subspan(kFrameHeaderBytes);
}

void decode_body(Op op, uint8_t flags, ByteView body) {
  switch (op) {
    case Op::kHello:
      if (auto h = decode_hello(body); h.ok()) {
        FERRY_FUZZ_REQUIRE(decode_hello(body_of(encode_hello(*h))).ok());
      }
      break;
    case Op::kHelloAck:
      if (auto a = decode_hello_ack(body); a.ok()) {
        (void)decode_hello_ack(body_of(encode_hello_ack(*a)));
      }
      break;
    case Op::kHelloDone:
      if (auto d = decode_hello_done(body); d.ok()) {
        (void)decode_hello_done(body_of(encode_hello_done(*d)));
      }
      break;
    case Op::kWriteReq:
    case Op::kReadReq:
    case Op::kNotifyReq: {
      FrameHeader header;
      header.op = op;
      header.flags = flags;
      header.body_bytes = static_cast<uint32_t>(body.size());
      if (auto r = decode_request(header, body); r.ok()) {
        const Bytes again = encode_request(op, r->id, r->segments, r->has_notification,
                                           ByteView(r->notification), r->staged);
        auto h2 = decode_header(ByteView(again));
        FERRY_FUZZ_REQUIRE(h2.ok());
        FERRY_FUZZ_REQUIRE(decode_request(*h2, body_of(again)).ok());
      }
      break;
    }
    case Op::kResponse:
      if (auto r = decode_response(body); r.ok()) {
        FERRY_FUZZ_REQUIRE(decode_response(body_of(encode_response(r->id, r->status))).ok());
      }
      break;
    case Op::kCancel:
      if (auto ids = decode_cancel(body); ids.ok()) {
        const Bytes again = encode_cancel(*ids);
        auto back = decode_cancel(body_of(again));
        FERRY_FUZZ_REQUIRE(back.ok() && *back == *ids);
      }
      break;
    case Op::kRing:
      if (auto bytes = decode_ring(body); bytes.ok()) {
        auto back = decode_ring(body_of(encode_ring(*bytes)));
        FERRY_FUZZ_REQUIRE(back.ok() && *back == *bytes);
      }
      break;
    case Op::kRingWake:
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto in = fuzz::split_wire_input(data, size);
  if (in.whole_frame) {
    auto h = decode_header(in.rest);
    if (!h.ok() || in.rest.size() < kFrameHeaderBytes) return 0;
    FERRY_FUZZ_REQUIRE(h->body_bytes <= max_body_bytes(h->op));
    ByteView body = in.rest.subspan(kFrameHeaderBytes);
    if (body.size() > h->body_bytes) body = body.first(h->body_bytes);
    decode_body(h->op, h->flags, body);
    return 0;
  }
  const uint8_t pick = in.selector % 11;
  // A request ring's slot: the frame a peer wrote there (shm_request_ring.h).
  if (pick == 9) {
    if (auto r = decode_ring_request(in.rest, 3); r.ok()) {
      const Bytes again = encode_request(r->op, r->id, r->segments, r->has_notification,
                                         ByteView(r->notification), r->staged);
      FERRY_FUZZ_REQUIRE(decode_ring_request(ByteView(again), 3).ok());
    }
    return 0;
  }
  if (pick == 10) {
    if (auto a = decode_ring_answer(in.rest, 3); a.ok()) {
      FERRY_FUZZ_REQUIRE(decode_ring_answer(ByteView(encode_response(a->id, a->status)), 3).ok());
    }
    return 0;
  }
  if (pick == 8) {
    if (auto a = decode_address(in.rest); a.ok()) {
      auto back = decode_address(ByteView(encode_address(*a)));
      FERRY_FUZZ_REQUIRE(back.ok() && back->socket_path == a->socket_path && back->pid == a->pid);
    }
    return 0;
  }
  decode_body(static_cast<Op>(pick + 1), static_cast<uint8_t>(in.selector >> 4), in.rest);
  return 0;
}
