// The shm transport's wire codec: round trips, and rejection of truncated,
// oversized and unknown frames. Bodies are decoded from GuardedBuffers, so a
// decoder that reads one byte past its span crashes the test.
#include "transport/shm/shm_wire.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/byte_codec.h"
#include "guarded_buffer.h"

namespace ferry::shm {
namespace {

using testing::GuardedBuffer;

WireSegment segment(uint64_t i) {
  WireSegment s;
  s.remote.region_id = 7 + i;
  s.remote.adv_offset = 4096;
  s.remote.adv_length = 1 << 20;
  s.remote.key = 0x1122334455667788ull + i;
  s.remote.access = kAccessReadWrite;
  s.remote.offset = 64 * i;
  s.remote.length = 64;
  s.address = 0x7f0000000000ull + 4096 * i;
  return s;
}

struct Split {
  FrameHeader header;
  Bytes body;
};

Split split(const Bytes& frame) {
  EXPECT_GE(frame.size(), kFrameHeaderBytes);
  auto h = decode_header(ByteView(frame).first(kFrameHeaderBytes));
  EXPECT_TRUE(h.ok()) << h.status().to_string();
  Split out;
  if (h.ok()) out.header = *h;
  out.body.assign(frame.begin() + kFrameHeaderBytes, frame.end());
  EXPECT_EQ(out.body.size(), out.header.body_bytes);
  return out;
}

Bytes header_bytes(uint32_t magic, uint16_t version, uint8_t op, uint8_t flags, uint32_t body,
                   uint32_t reserved = 0) {
  Bytes out;
  ByteWriter w(out);
  w.u32(magic);
  w.u16(version);
  w.u8(op);
  w.u8(flags);
  w.u32(body);
  w.u32(reserved);
  return out;
}

TEST(ShmWire, RequestRoundTrip) {
  std::vector<WireSegment> segs;
  for (uint64_t i = 0; i < 3; ++i) segs.push_back(segment(i));
  const Bytes note = {'d', 'o', 'n', 'e'};
  const Split f = split(encode_request(Op::kWriteReq, 42, segs, true, note));
  EXPECT_EQ(f.header.op, Op::kWriteReq);
  EXPECT_EQ(f.header.flags, kFlagNotification);
  EXPECT_EQ(f.body.size(), kRequestFixedBytes + 3 * kSegmentBytes + note.size());
  GuardedBuffer g(f.body);
  auto r = decode_request(f.header, g.span());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->id, 42u);
  EXPECT_TRUE(r->has_notification);
  EXPECT_EQ(r->notification, note);
  ASSERT_EQ(r->segments.size(), 3u);
  for (uint64_t i = 0; i < 3; ++i) {
    const WireSegment& a = r->segments[i];
    const WireSegment b = segment(i);
    EXPECT_EQ(a.remote.region_id, b.remote.region_id);
    EXPECT_EQ(a.remote.adv_offset, b.remote.adv_offset);
    EXPECT_EQ(a.remote.adv_length, b.remote.adv_length);
    EXPECT_EQ(a.remote.key, b.remote.key);
    EXPECT_EQ(a.remote.access, b.remote.access);
    EXPECT_EQ(a.remote.offset, b.remote.offset);
    EXPECT_EQ(a.remote.length, b.remote.length);
    EXPECT_EQ(a.address, b.address);
  }
}

TEST(ShmWire, WriteWithEmptyNotificationKeepsIt) {
  const std::vector<WireSegment> segs = {segment(0)};
  const Split f = split(encode_request(Op::kWriteReq, 1, segs, true, {}));
  auto r = decode_request(f.header, f.body);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->has_notification);
  EXPECT_TRUE(r->notification.empty());
  const Split plain = split(encode_request(Op::kWriteReq, 2, segs, false, {}));
  auto p = decode_request(plain.header, plain.body);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->has_notification);
}

TEST(ShmWire, NotifyAndReadRoundTrip) {
  const Bytes note(1000, 0x5a);
  const Split n = split(encode_request(Op::kNotifyReq, 9, {}, true, note));
  auto r = decode_request(n.header, n.body);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->segments.empty());
  EXPECT_EQ(r->notification, note);

  const std::vector<WireSegment> segs = {segment(1)};
  const Split rd = split(encode_request(Op::kReadReq, 10, segs, false, {}));
  EXPECT_EQ(rd.header.flags, 0);
  auto q = decode_request(rd.header, rd.body);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->op, Op::kReadReq);
  EXPECT_FALSE(q->has_notification);
}

TEST(ShmWire, TruncatedRequestBodiesAreRejected) {
  std::vector<WireSegment> segs = {segment(0), segment(1)};
  const Split f = split(encode_request(Op::kWriteReq, 5, segs, true, Bytes{1, 2, 3}));
  for (size_t n = 0; n < f.body.size(); ++n) {
    GuardedBuffer g(ByteView(f.body).first(n));
    auto r = decode_request(f.header, g.span());
    ASSERT_FALSE(r.ok()) << "prefix of " << n << " bytes accepted";
    EXPECT_EQ(r.status().code(), StatusCode::kProtocolError);
  }
  // One byte too many is as wrong as one too few.
  Bytes longer = f.body;
  longer.push_back(0);
  EXPECT_FALSE(decode_request(f.header, longer).ok());
}

TEST(ShmWire, ImpossibleRequestsAreRejected) {
  // Segment count 0 on a WRITE_REQ, or above the limit.
  {
    Split f = split(encode_request(Op::kWriteReq, 1, {}, false, {}));
    EXPECT_FALSE(decode_request(f.header, f.body).ok());
  }
  {
    std::vector<WireSegment> many(kMaxRequestSegments + 1, segment(0));
    Split f = split(encode_request(Op::kReadReq, 1, many, false, {}));
    auto r = decode_request(f.header, f.body);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("1025 segments"), std::string::npos)
        << r.status().message();
  }
  // Zero-length and wrapping segments.
  {
    WireSegment s = segment(0);
    s.remote.length = 0;
    Split f = split(encode_request(Op::kWriteReq, 1, std::vector<WireSegment>{s}, false, {}));
    EXPECT_FALSE(decode_request(f.header, f.body).ok());
    s = segment(0);
    s.address = UINT64_MAX - 8;
    f = split(encode_request(Op::kWriteReq, 1, std::vector<WireSegment>{s}, false, {}));
    EXPECT_FALSE(decode_request(f.header, f.body).ok());
  }
  // A notification on a WRITE_REQ without the flag, or on a READ_REQ.
  {
    Split f = split(
        encode_request(Op::kWriteReq, 1, std::vector<WireSegment>{segment(0)}, false, Bytes{1}));
    EXPECT_FALSE(decode_request(f.header, f.body).ok());
    f = split(
        encode_request(Op::kReadReq, 1, std::vector<WireSegment>{segment(0)}, true, Bytes{1}));
    EXPECT_FALSE(decode_request(f.header, f.body).ok());
  }
  // Segments on a NOTIFY_REQ.
  {
    Split f =
        split(encode_request(Op::kNotifyReq, 1, std::vector<WireSegment>{segment(0)}, true, {}));
    EXPECT_FALSE(decode_request(f.header, f.body).ok());
  }
  // A notification above 1 MiB announced in the body.
  {
    Bytes body;
    ByteWriter w(body);
    w.u64(1);
    w.u32(0);
    w.u32(kMaxNotificationBytes + 1);
    FrameHeader h;
    h.op = Op::kNotifyReq;
    h.body_bytes = static_cast<uint32_t>(body.size());
    EXPECT_FALSE(decode_request(h, body).ok());
  }
}

TEST(ShmWire, BadHeadersAreRejected) {
  const uint8_t write = static_cast<uint8_t>(Op::kWriteReq);
  EXPECT_TRUE(decode_header(header_bytes(kFrameMagic, kWireVersion, write, 0, 100)).ok());
  // Truncated header.
  const Bytes good = header_bytes(kFrameMagic, kWireVersion, write, 0, 100);
  for (size_t n = 0; n < kFrameHeaderBytes; ++n) {
    GuardedBuffer g(ByteView(good).first(n));
    EXPECT_FALSE(decode_header(g.span()).ok()) << n;
  }
  EXPECT_FALSE(decode_header(header_bytes(0x12345678, kWireVersion, write, 0, 100)).ok());
  for (uint8_t op : {uint8_t{0}, uint8_t{11}, uint8_t{255}}) {
    auto h = decode_header(header_bytes(kFrameMagic, kWireVersion, op, 0, 0));
    ASSERT_FALSE(h.ok());
    EXPECT_EQ(h.status().code(), StatusCode::kProtocolError);
    EXPECT_NE(h.status().message().find("unknown opcode"), std::string::npos);
  }
  // Oversized bodies, per op.
  EXPECT_FALSE(decode_header(header_bytes(kFrameMagic, kWireVersion, write, 0,
                                          static_cast<uint32_t>(max_body_bytes(Op::kWriteReq) + 1)))
                   .ok());
  EXPECT_FALSE(
      decode_header(header_bytes(kFrameMagic, kWireVersion, static_cast<uint8_t>(Op::kResponse), 0,
                                 kResponseFixedBytes + kMaxMessageBytes + 1))
          .ok());
  EXPECT_FALSE(decode_header(header_bytes(kFrameMagic, kWireVersion,
                                          static_cast<uint8_t>(Op::kHello), 0, UINT32_MAX))
                   .ok());
  // Flags only where defined; reserved must be zero.
  EXPECT_TRUE(
      decode_header(header_bytes(kFrameMagic, kWireVersion, write, kFlagNotification, 0)).ok());
  EXPECT_FALSE(decode_header(header_bytes(kFrameMagic, kWireVersion,
                                          static_cast<uint8_t>(Op::kReadReq), kFlagNotification, 0))
                   .ok());
  EXPECT_FALSE(decode_header(header_bytes(kFrameMagic, kWireVersion, write, 0, 0, 1)).ok());
  // Data frames must speak our version; handshake frames pass it on.
  auto v = decode_header(header_bytes(kFrameMagic, kWireVersion + 1, write, 0, 0));
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("version"), std::string::npos);
  auto hello = decode_header(
      header_bytes(kFrameMagic, kWireVersion + 1, static_cast<uint8_t>(Op::kHello), 0, 40));
  ASSERT_TRUE(hello.ok());
  EXPECT_EQ(hello->version, kWireVersion + 1);
}

TEST(ShmWire, ResponseRoundTripAndLimits) {
  const Split ok = split(encode_response(3, Status::Ok()));
  auto r = decode_response(ok.body);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->id, 3u);
  EXPECT_TRUE(r->status.ok());

  const Split bad = split(encode_response(4, err::OutOfRange("region 7: op [10, +5) is outside")));
  GuardedBuffer g(bad.body);
  auto e = decode_response(g.span());
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->status.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(e->status.message(), "region 7: op [10, +5) is outside");
  for (size_t n = 0; n < bad.body.size(); ++n) {
    GuardedBuffer p(ByteView(bad.body).first(n));
    EXPECT_FALSE(decode_response(p.span()).ok()) << n;
  }
  // Long messages are clipped by the encoder, never rejected by the decoder.
  const Split longer = split(encode_response(5, err::Internal(std::string(10000, 'x'))));
  auto l = decode_response(longer.body);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->status.message().size(), kMaxMessageBytes);
  // Unknown status code.
  Bytes body = ok.body;
  body[8] = 200;
  EXPECT_FALSE(decode_response(body).ok());
  // The reserved u16 after the code.
  body = ok.body;
  body[10] = 1;
  auto reserved = decode_response(body);
  ASSERT_FALSE(reserved.ok());
  EXPECT_EQ(reserved.status().code(), StatusCode::kProtocolError);
  EXPECT_NE(reserved.status().message().find("reserved"), std::string::npos)
      << reserved.status().message();
}

TEST(ShmWire, HandshakeRoundTrips) {
  Hello h;
  h.engine_id = 0xabc;
  h.expected_engine_id = 0xdef;
  h.probe_address = 0x7fff0000;
  h.probe_value = 0x1234;
  const Split hf = split(encode_hello(h));
  EXPECT_EQ(hf.body.size(), kHelloBytes);
  auto hd = decode_hello(hf.body);
  ASSERT_TRUE(hd.ok());
  EXPECT_EQ(hd->engine_id, h.engine_id);
  EXPECT_EQ(hd->expected_engine_id, h.expected_engine_id);
  EXPECT_EQ(hd->probe_address, h.probe_address);
  EXPECT_EQ(hd->probe_value, h.probe_value);
  for (size_t n = 0; n < hf.body.size(); ++n) {
    GuardedBuffer g(ByteView(hf.body).first(n));
    EXPECT_FALSE(decode_hello(g.span()).ok());
  }
  Hello zero = h;
  zero.engine_id = 0;
  EXPECT_FALSE(decode_hello(split(encode_hello(zero)).body).ok());

  HelloAck a;
  a.engine_id = 0x99;
  a.probe_address = 0x1000;
  a.probe_value = 77;
  auto ad = decode_hello_ack(split(encode_hello_ack(a)).body);
  ASSERT_TRUE(ad.ok());
  EXPECT_TRUE(ad->status.ok());
  EXPECT_EQ(ad->engine_id, 0x99u);
  EXPECT_EQ(ad->probe_value, 77u);

  HelloAck refused;
  refused.engine_id = 0x99;
  refused.status = err::PermissionDenied("cross-memory attach to pid 1 refused");
  auto rd = decode_hello_ack(split(encode_hello_ack(refused)).body);
  ASSERT_TRUE(rd.ok());
  EXPECT_EQ(rd->status.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(rd->status.message(), refused.status.message());

  HelloDone no;
  no.status = err::NotSupported("no");
  auto nd = decode_hello_done(split(encode_hello_done(no)).body);
  ASSERT_TRUE(nd.ok()) << nd.status().to_string();
  EXPECT_EQ(nd->status.code(), StatusCode::kNotSupported);
  EXPECT_EQ(nd->status.message(), "no");
  EXPECT_FALSE(decode_hello_done(Bytes{0, 0}).ok());
  HelloDone cma;
  auto cd = decode_hello_done(split(encode_hello_done(cma)).body);
  ASSERT_TRUE(cd.ok()) << cd.status().to_string();
  EXPECT_TRUE(cd->status.ok());
  EXPECT_EQ(cd->mode, Mode::kCma);
  EXPECT_TRUE(cd->cma_refusal.empty());
  EXPECT_EQ(cd->staging_bytes, 0u);
}

TEST(ShmWire, HandshakeCarriesModesRefusalsAndAreas) {
  Hello h;
  h.engine_id = 1;
  h.probe_address = 0x1000;
  h.mode = Mode::kStaging;
  auto hd = decode_hello(split(encode_hello(h)).body);
  ASSERT_TRUE(hd.ok()) << hd.status().to_string();
  EXPECT_EQ(hd->mode, Mode::kStaging);
  // An unknown mode, and the reserved bytes beside it.
  Bytes body = split(encode_hello(h)).body;
  body[28] = 3;
  EXPECT_FALSE(decode_hello(body).ok());
  body = split(encode_hello(h)).body;
  body[30] = 1;
  EXPECT_FALSE(decode_hello(body).ok());

  // Ok, but the acceptor's probe failed: the reason travels, with an area.
  HelloAck a;
  a.engine_id = 2;
  a.probe_address = 0x2000;
  a.mode = Mode::kAuto;
  a.cma_refusal = "cross-memory attach to pid 7 refused: EPERM";
  a.staging_bytes = 32 << 20;
  const Split af = split(encode_hello_ack(a));
  EXPECT_EQ(af.body.size(), kHelloAckFixedBytes + a.cma_refusal.size());
  auto ad = decode_hello_ack(af.body);
  ASSERT_TRUE(ad.ok()) << ad.status().to_string();
  EXPECT_TRUE(ad->status.ok());
  EXPECT_EQ(ad->cma_refusal, a.cma_refusal);
  EXPECT_EQ(ad->staging_bytes, a.staging_bytes);
  EXPECT_EQ(ad->mode, Mode::kAuto);
  EXPECT_EQ(ad->features, 0u);
  // The features word (reserved, and ignored, before kFeatureGpuAreas):
  // round trip, and unknown bits dropped rather than refused.
  HelloAck with_gpu = a;
  with_gpu.features = kFeatureGpuAreas;
  Bytes fb = split(encode_hello_ack(with_gpu)).body;
  auto wg = decode_hello_ack(fb);
  ASSERT_TRUE(wg.ok()) << wg.status().to_string();
  EXPECT_EQ(wg->features, kFeatureGpuAreas);
  fb[31] = 0x80;  // a future bit
  wg = decode_hello_ack(fb);
  ASSERT_TRUE(wg.ok()) << wg.status().to_string();
  EXPECT_EQ(wg->features, kFeatureGpuAreas);
  for (size_t n = 0; n < af.body.size(); ++n) {
    GuardedBuffer g(ByteView(af.body).first(n));
    EXPECT_FALSE(decode_hello_ack(g.span()).ok()) << n;
  }
  // The area flag without a size, a size without the flag, unknown flags,
  // the refusal flag without a message.
  body = af.body;
  body[3] &= static_cast<uint8_t>(~kHandshakeArea);
  EXPECT_FALSE(decode_hello_ack(body).ok());
  body = af.body;
  std::memset(body.data() + 40, 0, 8);
  EXPECT_FALSE(decode_hello_ack(body).ok());
  body = af.body;
  body[3] |= 0x80;
  EXPECT_FALSE(decode_hello_ack(body).ok());
  HelloAck plain = a;
  plain.cma_refusal.clear();
  body = split(encode_hello_ack(plain)).body;
  ASSERT_TRUE(decode_hello_ack(body).ok());
  body[3] |= kHandshakeCmaRefused;
  EXPECT_FALSE(decode_hello_ack(body).ok());

  HelloDone d;
  d.mode = Mode::kStaging;
  d.cma_refusal = "cross-memory attach to pid 9 refused";
  d.staging_bytes = 1 << 20;
  const Split df = split(encode_hello_done(d));
  EXPECT_EQ(df.body.size(), kHelloDoneFixedBytes + d.cma_refusal.size());
  auto dd = decode_hello_done(df.body);
  ASSERT_TRUE(dd.ok()) << dd.status().to_string();
  EXPECT_EQ(dd->mode, Mode::kStaging);
  EXPECT_EQ(dd->cma_refusal, d.cma_refusal);
  EXPECT_EQ(dd->staging_bytes, d.staging_bytes);
  for (size_t n = 0; n < df.body.size(); ++n) {
    GuardedBuffer g(ByteView(df.body).first(n));
    EXPECT_FALSE(decode_hello_done(g.span()).ok()) << n;
  }
  // Staging without an area, an accepted connection without a mode. Cross-
  // memory attach with an area decodes (GPU areas, kFeatureGpuAreas): the
  // acceptor refuses it unless it offered that.
  HelloDone bad = d;
  bad.staging_bytes = 0;
  EXPECT_FALSE(decode_hello_done(split(encode_hello_done(bad)).body).ok());
  HelloDone gpu_areas = d;
  gpu_areas.mode = Mode::kCma;
  gpu_areas.cma_refusal.clear();
  auto ga = decode_hello_done(split(encode_hello_done(gpu_areas)).body);
  ASSERT_TRUE(ga.ok()) << ga.status().to_string();
  EXPECT_EQ(ga->mode, Mode::kCma);
  EXPECT_EQ(ga->staging_bytes, gpu_areas.staging_bytes);
  bad = d;
  bad.mode = Mode::kAuto;
  bad.staging_bytes = 0;
  EXPECT_FALSE(decode_hello_done(split(encode_hello_done(bad)).body).ok());
}

TEST(ShmWire, StagedRequestsNameOffsets) {
  // Offset 0 is the start of the area: allowed only with kFlagStaged.
  WireSegment s = segment(0);
  s.address = 0;
  Split f = split(encode_request(Op::kWriteReq, 5, std::vector<WireSegment>{s}, true, Bytes{1, 2},
                                 /*staged=*/true));
  EXPECT_EQ(f.header.flags, kFlagNotification | kFlagStaged);
  auto r = decode_request(f.header, f.body);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->staged);
  EXPECT_TRUE(r->has_notification);
  EXPECT_EQ(r->segments[0].address, 0u);
  f = split(encode_request(Op::kReadReq, 6, std::vector<WireSegment>{s}, false, {}, true));
  EXPECT_EQ(f.header.flags, kFlagStaged);
  r = decode_request(f.header, f.body);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->staged);
  f = split(encode_request(Op::kReadReq, 6, std::vector<WireSegment>{s}, false, {}, false));
  EXPECT_FALSE(decode_request(f.header, f.body).ok());
  // Wrapping offsets stay impossible.
  s.address = UINT64_MAX - 8;
  f = split(encode_request(Op::kWriteReq, 7, std::vector<WireSegment>{s}, false, {}, true));
  EXPECT_FALSE(decode_request(f.header, f.body).ok());
  // The flag is refused on a NOTIFY_REQ header and on responses.
  EXPECT_FALSE(decode_header(header_bytes(kFrameMagic, kWireVersion,
                                          static_cast<uint8_t>(Op::kNotifyReq), kFlagStaged, 16))
                   .ok());
  EXPECT_FALSE(decode_header(header_bytes(kFrameMagic, kWireVersion,
                                          static_cast<uint8_t>(Op::kResponse), kFlagStaged, 16))
                   .ok());
  EXPECT_STREQ(mode_name(Mode::kStaging), "staging");
}

TEST(ShmWire, AddressRoundTripAndRejection) {
  const ShmAddress a{"/tmp/ferry-0123456789abcdef-42.sock", 42};
  auto d = decode_address(encode_address(a));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->socket_path, a.socket_path);
  EXPECT_EQ(d->pid, 42u);
  const Bytes enc = encode_address(a);
  for (size_t n = 0; n < enc.size(); ++n) {
    GuardedBuffer g(ByteView(enc).first(n));
    EXPECT_FALSE(decode_address(g.span()).ok()) << n;
  }
  Bytes wrong_format = enc;
  wrong_format[0] = 2;
  EXPECT_FALSE(decode_address(wrong_format).ok());
  EXPECT_FALSE(decode_address(encode_address({"relative.sock", 1})).ok());
  EXPECT_FALSE(decode_address(encode_address({"/" + std::string(200, 'a'), 1})).ok());
}

}  // namespace
}  // namespace ferry::shm
