// libFuzzer target: cuda_ipc's control-socket decoders (src/transport/
// cuda_ipc/cuda_ipc_wire.h) and its metadata address must reject or accept
// any bytes without reading out of bounds; what they accept re-encodes to a
// frame that decodes again. The decoders need no GPU: this target runs on
// any machine.
#include "transport/cuda_ipc/cuda_ipc_wire.h"
#include "wire_fuzz_util.h"

namespace {

using namespace ferry;
using namespace ferry::cuda_ipc;

ByteView body_of(const Bytes& frame) {
  auto h = decode_header(ByteView(frame));
  FERRY_FUZZ_REQUIRE(h.ok() && h->body_bytes == frame.size() - kFrameHeaderBytes);
  return ByteView(frame).subspan(kFrameHeaderBytes);
}

void decode_body(Op op, ByteView body) {
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
    case Op::kGrantRequest:
      if (auto g = decode_grant_request(body); g.ok()) {
        FERRY_FUZZ_REQUIRE(decode_grant_request(body_of(encode_grant_request(*g))).ok());
      }
      break;
    case Op::kGrant:
      if (auto g = decode_grant(body); g.ok()) {
        auto back = decode_grant(body_of(encode_grant(*g)));
        FERRY_FUZZ_REQUIRE(back.ok() && back->pieces.size() == g->pieces.size());
      }
      break;
    case Op::kFds:
      if (auto n = decode_fds(body); n.ok()) {
        FERRY_FUZZ_REQUIRE(*n <= kMaxFdsPerFrame);
      }
      break;
    case Op::kRevoke:
    case Op::kRevokeAck:
      if (auto ids = decode_revoke(body); ids.ok()) {
        auto back = decode_revoke(body_of(encode_revoke(op, *ids)));
        FERRY_FUZZ_REQUIRE(back.ok() && *back == *ids);
      }
      break;
    case Op::kNotify:
      break;  // the payload is opaque bytes
    case Op::kPushExport:
      if (auto e = decode_push_export(body); e.ok()) {
        FERRY_FUZZ_REQUIRE(decode_push_export(body_of(encode_push_export(*e))).ok());
      }
      break;
    case Op::kCopyRequest:
      if (auto q = decode_copy_request(body); q.ok()) {
        auto back = decode_copy_request(body_of(encode_copy_request(*q)));
        FERRY_FUZZ_REQUIRE(back.ok() && back->segments.size() == q->segments.size() &&
                           back->notification == q->notification);
      }
      break;
    case Op::kCopyResponse:
      if (auto r = decode_copy_response(body); r.ok()) {
        FERRY_FUZZ_REQUIRE(decode_copy_response(body_of(encode_copy_response(*r))).ok());
      }
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto in = fuzz::split_wire_input(data, size);
  if (in.whole_frame) {
    if (in.rest.size() < kFrameHeaderBytes) return 0;
    auto h = decode_header(in.rest);
    if (!h.ok()) return 0;
    FERRY_FUZZ_REQUIRE(h->body_bytes <= max_body_bytes(h->op));
    ByteView body = in.rest.subspan(kFrameHeaderBytes);
    if (body.size() > h->body_bytes) body = body.first(h->body_bytes);
    decode_body(h->op, body);
    return 0;
  }
  const uint8_t pick = in.selector % 12;
  if (pick == 11) {
    if (auto a = decode_address(in.rest); a.ok()) {
      auto back = decode_address(ByteView(encode_address(*a)));
      FERRY_FUZZ_REQUIRE(back.ok() && back->socket_path == a->socket_path && back->gpus == a->gpus);
    }
    return 0;
  }
  decode_body(static_cast<Op>(pick + 1), in.rest);
  return 0;
}
