// libFuzzer target: the fabric transport's control messages (src/transport/
// fabric/fabric_wire.h) -- header and every body decoder -- must reject or
// accept any bytes without reading out of bounds; what they accept
// re-encodes to bytes that decode again. The decoders need no libfabric.
#include "transport/fabric/fabric_wire.h"
#include "wire_fuzz_util.h"

namespace {

using namespace ferry;
using namespace ferry::fabric;

void decode_body(uint8_t type, ByteView body) {
  switch (static_cast<MsgType>(type)) {
    case MsgType::kHello:
      if (auto h = decode_hello(body); h.ok()) {
        const Bytes again = encode_hello(*h);
        auto back = decode_hello(ByteView(again));
        FERRY_FUZZ_REQUIRE(back.ok() && back->provider == h->provider &&
                           back->address == h->address && back->expected == h->expected);
      }
      break;
    case MsgType::kHelloAck: {
      Status s;
      if (decode_status(body, &s).ok()) {
        Status again;
        const Bytes bytes = encode_status(s);
        FERRY_FUZZ_REQUIRE(decode_status(ByteView(bytes), &again).ok() && again.code() == s.code());
      }
      break;
    }
    case MsgType::kGrantReq:
      if (auto g = decode_grant_req(body); g.ok()) {
        const Bytes again = encode_grant_req(*g);
        FERRY_FUZZ_REQUIRE(decode_grant_req(ByteView(again)).ok());
      }
      break;
    case MsgType::kGrant:
      if (auto g = decode_grant(body); g.ok()) {
        const Bytes again = encode_grant(*g);
        auto back = decode_grant(ByteView(again));
        FERRY_FUZZ_REQUIRE(back.ok() && back->mr_key == g->mr_key && back->base == g->base);
      }
      break;
    case MsgType::kRevoke:
    case MsgType::kRevokeAck:
      if (auto v = decode_u64(body, "region id"); v.ok()) {
        const Bytes again = encode_u64(*v);
        FERRY_FUZZ_REQUIRE(decode_u64(ByteView(again), "region id").value() == *v);
      }
      break;
    default:
      break;  // NOTIFY's payload is opaque; PING, PONG, BYE have no body
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto in = fuzz::split_wire_input(data, size);
  if (in.whole_frame) {
    auto h = decode_header(in.rest.data(), in.rest.size());
    if (!h.ok()) return 0;
    FERRY_FUZZ_REQUIRE(kHeaderBytes + h->body_bytes <= in.rest.size());
    decode_body(h->type, in.rest.subspan(kHeaderBytes, h->body_bytes));
    return 0;
  }
  decode_body(static_cast<uint8_t>(in.selector % 11), in.rest);
  return 0;
}
