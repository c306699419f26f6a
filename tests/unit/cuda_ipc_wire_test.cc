// The cuda_ipc transport's wire codec for the target-driven path (local GPU
// with peer host memory): PUSH_EXPORT, COPY_REQ, COPY_RESP round trips, and
// every truncation, bad count and bad field refused with ProtocolError. Bodies
// are decoded from GuardedBuffers, so a read past the span crashes the test.
// Also: the largest COPY_REQs pass the receiver's header check, and cross a
// control socket prepared as the transport prepares it whole, though they are
// larger than the socket's buffer.
#include "transport/cuda_ipc/cuda_ipc_wire.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "ferry/gpu.h"
#include "guarded_buffer.h"
#include "transport/common/unix_socket.h"

namespace ferry::cuda_ipc {
namespace {

using testing::GuardedBuffer;

// The body of a whole frame, after checking its header names `op`.
Bytes body_of(const Bytes& frame, Op op) {
  auto h = decode_header(ByteView(frame.data(), kFrameHeaderBytes));
  EXPECT_TRUE(h.ok()) << h.status().message();
  EXPECT_EQ(h->op, op);
  EXPECT_EQ(h->body_bytes, frame.size() - kFrameHeaderBytes);
  EXPECT_LE(h->body_bytes, max_body_bytes(op));
  return Bytes(frame.begin() + kFrameHeaderBytes, frame.end());
}

template <typename Decode>
void ExpectEveryTruncationRefused(const Bytes& body, Decode decode) {
  for (size_t n = 0; n < body.size(); ++n) {
    GuardedBuffer g(std::span<const uint8_t>(body.data(), n));
    auto r = decode(ByteView(g.span().data(), g.span().size()));
    ASSERT_FALSE(r.ok()) << "a body cut to " << n << " of " << body.size() << " bytes";
    EXPECT_EQ(r.status().code(), StatusCode::kProtocolError) << r.status().message();
  }
}

template <typename Decode>
auto Decode1(const Bytes& body, Decode decode) {
  GuardedBuffer g(std::span<const uint8_t>(body.data(), body.size()));
  return decode(ByteView(g.span().data(), g.span().size()));
}

PushExport SampleExport(HandleKind kind, uint32_t pieces) {
  PushExport e;
  e.export_id = 42;
  e.grant.kind = kind;
  for (int i = 0; i < 16; ++i) e.grant.gpu_uuid[i] = static_cast<uint8_t>(i + 1);
  e.grant.buffer_id = 0xabcdef;
  e.grant.span_base = 0x7f0000000000ull;
  e.grant.region_address = e.grant.span_base + 4096;
  e.grant.span_length = uint64_t{pieces} << 21;
  for (uint32_t i = 0; i < pieces; ++i) {
    Piece p;
    p.offset = uint64_t{i} << 21;
    p.length = 1 << 21;
    p.handle[0] = static_cast<uint8_t>(i + 7);
    p.handle[63] = 0x5a;
    e.grant.pieces.push_back(p);
  }
  return e;
}

CopyRequest SampleRequest(uint32_t segments, bool notify) {
  CopyRequest q;
  q.id = 99;
  q.direction = CopyDirection::kWrite;
  for (uint32_t i = 0; i < segments; ++i) {
    CopySegment s;
    s.remote.region_id = 5 + i;
    s.remote.adv_offset = 128;
    s.remote.adv_length = 1 << 20;
    s.remote.key = 0x1122334455667788ull + i;
    s.remote.access = kAccessReadWrite;
    s.remote.offset = 4096ull * i;
    s.remote.length = 4096;
    s.export_id = 3;
    s.export_offset = 8192ull * i;
    q.segments.push_back(s);
  }
  if (notify) {
    q.has_notification = true;
    q.notification = Bytes{'k', 'v', 0, 1};
  }
  return q;
}

TEST(CudaIpcWire, PushExportRoundTrip) {
  for (HandleKind kind : {HandleKind::kLegacy, HandleKind::kVmm}) {
    const PushExport e = SampleExport(kind, kind == HandleKind::kLegacy ? 1 : 3);
    const Bytes body = body_of(encode_push_export(e), Op::kPushExport);
    auto back = Decode1(body, decode_push_export);
    ASSERT_TRUE(back.ok()) << back.status().message();
    EXPECT_EQ(back->export_id, e.export_id);
    EXPECT_EQ(back->grant.kind, kind);
    EXPECT_EQ(back->grant.gpu_uuid, e.grant.gpu_uuid);
    EXPECT_EQ(back->grant.buffer_id, e.grant.buffer_id);
    EXPECT_EQ(back->grant.region_address, e.grant.region_address);
    EXPECT_EQ(back->grant.span_base, e.grant.span_base);
    EXPECT_EQ(back->grant.span_length, e.grant.span_length);
    ASSERT_EQ(back->grant.pieces.size(), e.grant.pieces.size());
    for (size_t i = 0; i < e.grant.pieces.size(); ++i) {
      EXPECT_EQ(back->grant.pieces[i].offset, e.grant.pieces[i].offset);
      EXPECT_EQ(back->grant.pieces[i].length, e.grant.pieces[i].length);
      EXPECT_EQ(back->grant.pieces[i].handle, e.grant.pieces[i].handle);
    }
    ExpectEveryTruncationRefused(body, decode_push_export);
    Bytes longer = body;
    longer.push_back(0);
    EXPECT_EQ(Decode1(longer, decode_push_export).status().code(), StatusCode::kProtocolError);
  }
}

TEST(CudaIpcWire, PushExportBadFieldsRefused) {
  auto refused = [](const PushExport& e) {
    auto r = Decode1(body_of(encode_push_export(e), Op::kPushExport), decode_push_export);
    return !r.ok() && r.status().code() == StatusCode::kProtocolError;
  };
  PushExport e = SampleExport(HandleKind::kVmm, 2);
  e.grant.kind = static_cast<HandleKind>(9);
  EXPECT_TRUE(refused(e)) << "unknown handle kind";
  e = SampleExport(HandleKind::kLegacy, 2);
  EXPECT_TRUE(refused(e)) << "a legacy export has one piece";
  e = SampleExport(HandleKind::kVmm, 2);
  e.grant.pieces[1].offset += 1;
  EXPECT_TRUE(refused(e)) << "a gap between pieces";
  e = SampleExport(HandleKind::kVmm, 2);
  e.grant.span_length += 1;
  EXPECT_TRUE(refused(e)) << "pieces short of the span";
  e = SampleExport(HandleKind::kVmm, 2);
  e.grant.region_address = e.grant.span_base + e.grant.span_length;
  EXPECT_TRUE(refused(e)) << "region address outside the span";
  e = SampleExport(HandleKind::kVmm, 1);
  e.grant.pieces.clear();
  EXPECT_TRUE(refused(e)) << "no pieces";

  // A piece count larger than the body.
  Bytes body = body_of(encode_push_export(SampleExport(HandleKind::kVmm, 1)), Op::kPushExport);
  const uint32_t huge = 1000;
  std::memcpy(body.data() + 8 + 4, &huge, 4);
  EXPECT_EQ(Decode1(body, decode_push_export).status().code(), StatusCode::kProtocolError);
}

TEST(CudaIpcWire, CopyRequestRoundTrip) {
  for (uint32_t n : {1u, 64u, kMaxCopySegments}) {
    for (bool notify : {false, true}) {
      const CopyRequest q = SampleRequest(n, notify);
      const Bytes body = body_of(encode_copy_request(q), Op::kCopyRequest);
      EXPECT_EQ(body.size(), kCopyRequestHeadBytes + n * kCopySegmentBytes + q.notification.size());
      auto back = Decode1(body, decode_copy_request);
      ASSERT_TRUE(back.ok()) << back.status().message();
      EXPECT_EQ(back->id, q.id);
      EXPECT_EQ(back->direction, q.direction);
      EXPECT_EQ(back->has_notification, notify);
      EXPECT_EQ(back->notification, q.notification);
      ASSERT_EQ(back->segments.size(), n);
      for (uint32_t i = 0; i < n; ++i) {
        const CopySegment& a = back->segments[i];
        const CopySegment& b = q.segments[i];
        EXPECT_EQ(a.remote.region_id, b.remote.region_id);
        EXPECT_EQ(a.remote.adv_offset, b.remote.adv_offset);
        EXPECT_EQ(a.remote.adv_length, b.remote.adv_length);
        EXPECT_EQ(a.remote.key, b.remote.key);
        EXPECT_EQ(a.remote.access, b.remote.access);
        EXPECT_EQ(a.remote.offset, b.remote.offset);
        EXPECT_EQ(a.remote.length, b.remote.length);
        EXPECT_EQ(a.export_id, b.export_id);
        EXPECT_EQ(a.export_offset, b.export_offset);
      }
      if (n <= 64) ExpectEveryTruncationRefused(body, decode_copy_request);
    }
  }
  CopyRequest read = SampleRequest(2, false);
  read.direction = CopyDirection::kRead;
  auto back = Decode1(body_of(encode_copy_request(read), Op::kCopyRequest), decode_copy_request);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->direction, CopyDirection::kRead);
}

TEST(CudaIpcWire, CopyRequestBadFieldsRefused) {
  auto refused = [](const Bytes& body) {
    auto r = Decode1(body, decode_copy_request);
    return !r.ok() && r.status().code() == StatusCode::kProtocolError;
  };
  const Bytes good = body_of(encode_copy_request(SampleRequest(2, true)), Op::kCopyRequest);
  ASSERT_FALSE(refused(good));
  Bytes b = good;
  b[8] = 3;  // direction
  EXPECT_TRUE(refused(b)) << "unknown direction";
  b = good;
  b[9] = 2;  // flags
  EXPECT_TRUE(refused(b)) << "unknown flag";
  b = good;
  b[10] = 1;  // reserved u16
  EXPECT_TRUE(refused(b)) << "reserved bytes set";
  b = good;
  b[20] = 1;  // reserved u32
  EXPECT_TRUE(refused(b)) << "reserved bytes set";
  b = good;
  b[8] = static_cast<uint8_t>(CopyDirection::kRead);
  EXPECT_TRUE(refused(b)) << "a read with a notification";
  b = good;
  b[9] = 0;
  EXPECT_TRUE(refused(b)) << "notification bytes without the flag";
  auto set_u32 = [](Bytes& body, size_t at, uint32_t v) { std::memcpy(body.data() + at, &v, 4); };
  b = good;
  set_u32(b, 12, 0);
  EXPECT_TRUE(refused(b)) << "no segments";
  b = good;
  set_u32(b, 12, 3);
  EXPECT_TRUE(refused(b)) << "more segments than the body holds";
  b = good;
  set_u32(b, 12, 1);
  EXPECT_TRUE(refused(b)) << "fewer segments than the body holds";
  b = good;
  set_u32(b, 12, kMaxCopySegments + 1);
  EXPECT_TRUE(refused(b)) << "over the segment limit";
  b = good;
  set_u32(b, 16, 5);
  EXPECT_TRUE(refused(b)) << "a notification length that does not match";
  b = good;
  set_u32(b, 16, kMaxNotificationBytes + 1);
  EXPECT_TRUE(refused(b)) << "a notification over the limit";
  b = good;
  b.push_back(0);
  EXPECT_TRUE(refused(b)) << "a trailing byte";
  // The second segment's padding after its access byte (24-byte head, 72-byte segments).
  b = good;
  b[24 + kCopySegmentBytes + 72 - 1] = 1;
  EXPECT_TRUE(refused(b)) << "a segment's reserved bytes set";
}

TEST(CudaIpcWire, CopyResponseRoundTrip) {
  for (const Status& s :
       {Status::Ok(), err::PermissionDenied("segment 0: region 7: access key mismatch"),
        err::OutOfRange("segment 3: region 9: [4096, +8192) outside 8192 bytes")}) {
    const Bytes body = body_of(encode_copy_response({77, s}), Op::kCopyResponse);
    auto back = Decode1(body, decode_copy_response);
    ASSERT_TRUE(back.ok()) << back.status().message();
    EXPECT_EQ(back->request_id, 77u);
    EXPECT_EQ(back->status.code(), s.code());
    EXPECT_EQ(back->status.message(), s.message());
    ExpectEveryTruncationRefused(body, decode_copy_response);
    Bytes longer = body;
    longer.push_back('x');
    EXPECT_EQ(Decode1(longer, decode_copy_response).status().code(), StatusCode::kProtocolError);
  }
}

// Reserved fields travel as zeros and a set one is a protocol error: the
// status head's u16 (HELLO_ACK, GRANT, COPY_RESP) and GRANT_REQ's padding
// after the access byte.
TEST(CudaIpcWire, ReservedBytesSetAreRefused) {
  auto refused = [](auto decode, const Bytes& body) {
    auto r = Decode1(body, decode);
    return !r.ok() && r.status().code() == StatusCode::kProtocolError;
  };
  const Bytes ack = body_of(encode_hello_ack({Status::Ok(), 42}), Op::kHelloAck);
  ASSERT_FALSE(refused(decode_hello_ack, ack));
  Bytes b = ack;
  b[2] = 1;  // u16 code | u16 reserved | u32 length | ...
  EXPECT_TRUE(refused(decode_hello_ack, b));

  Grant g;
  g.request_id = 9;
  g.status = err::NotFound("region 5");
  const Bytes grant = body_of(encode_grant(g), Op::kGrant);
  ASSERT_FALSE(refused(decode_grant, grant));
  b = grant;
  b[8 + 3] = 0x80;  // u64 request id | u16 code | u16 reserved
  EXPECT_TRUE(refused(decode_grant, b));

  const Bytes resp = body_of(encode_copy_response({77, Status::Ok()}), Op::kCopyResponse);
  ASSERT_FALSE(refused(decode_copy_response, resp));
  b = resp;
  b[8 + 2] = 1;
  EXPECT_TRUE(refused(decode_copy_response, b));

  const Bytes req = body_of(encode_grant_request({5, 6, 0, 4096, 0xABCD, 3}), Op::kGrantRequest);
  ASSERT_EQ(req.size(), kGrantRequestBytes);
  auto back = Decode1(req, decode_grant_request);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->access, 3);
  EXPECT_EQ(back->key, 0xABCDu);
  for (size_t at = 41; at < kGrantRequestBytes; ++at) {
    b = req;
    b[at] = 1;
    EXPECT_TRUE(refused(decode_grant_request, b)) << "byte " << at;
  }
}

TEST(CudaIpcWire, NewOpsHaveNamesAndLimits) {
  EXPECT_STREQ(op_name(Op::kPushExport), "PUSH_EXPORT");
  EXPECT_STREQ(op_name(Op::kCopyRequest), "COPY_REQ");
  EXPECT_STREQ(op_name(Op::kCopyResponse), "COPY_RESP");
  // A header announcing more than the op's limit is refused before its body.
  Bytes frame = encode_copy_response({1, Status::Ok()});
  const uint32_t big = static_cast<uint32_t>(max_body_bytes(Op::kCopyResponse) + 1);
  std::memcpy(frame.data() + 8, &big, 4);
  EXPECT_EQ(decode_header(ByteView(frame.data(), kFrameHeaderBytes)).status().code(),
            StatusCode::kProtocolError);
  // An opcode past the last one.
  frame = encode_copy_response({1, Status::Ok()});
  frame[6] = static_cast<uint8_t>(Op::kCopyResponse) + 1;
  EXPECT_EQ(decode_header(ByteView(frame.data(), kFrameHeaderBytes)).status().code(),
            StatusCode::kProtocolError);
}

// The largest requests the initiator builds (kMaxCopySegments segments; with
// a notification of kMaxNotificationBytes when the batch is one request) pass
// the header check the receiver applies before it buffers the body; one
// segment more is refused by the decoder.
TEST(CudaIpcWire, LargestCopyRequestsPassTheReceiversChecks) {
  CopyRequest q = SampleRequest(kMaxCopySegments, true);
  q.notification.assign(kMaxNotificationBytes, 0x6b);
  for (bool notify : {false, true}) {
    if (!notify) {
      q.has_notification = false;
      q.notification.clear();
    } else {
      q.has_notification = true;
      q.notification.assign(kMaxNotificationBytes, 0x6b);
    }
    const Bytes frame = encode_copy_request(q);
    auto h = decode_header(ByteView(frame.data(), kFrameHeaderBytes));
    ASSERT_TRUE(h.ok()) << h.status().message();
    EXPECT_EQ(h->body_bytes, frame.size() - kFrameHeaderBytes);
    auto back = decode_copy_request(ByteView(frame.data() + kFrameHeaderBytes, h->body_bytes));
    ASSERT_TRUE(back.ok()) << back.status().message();
    EXPECT_EQ(back->segments.size(), kMaxCopySegments);
    EXPECT_EQ(back->notification.size(), q.notification.size());
  }
  CopyRequest over = SampleRequest(kMaxCopySegments + 1, false);
  const Bytes frame = encode_copy_request(over);
  auto h = decode_header(ByteView(frame.data(), kFrameHeaderBytes));
  ASSERT_TRUE(h.ok()) << h.status().message();
  auto back = decode_copy_request(ByteView(frame.data() + kFrameHeaderBytes, h->body_bytes));
  EXPECT_EQ(back.status().code(), StatusCode::kProtocolError);
}

// Reads frames as the transport's I/O thread does (unix_socket::receive with
// MSG_DONTWAIT into a growing buffer, decode_header before the body) until
// `want` frames came or 10 s passed.
std::vector<std::pair<Op, Bytes>> ReceiveFrames(int fd, size_t want) {
  std::vector<std::pair<Op, Bytes>> frames;
  Bytes rx;
  size_t len = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (frames.size() < want && std::chrono::steady_clock::now() < deadline) {
    rx.resize(len + (64 << 10));
    std::vector<int> fds;
    auto r = unix_socket::receive(fd, std::span<uint8_t>(rx.data() + len, 64 << 10), &fds);
    if (!r.ok() || *r == 0) break;
    if (*r < 0) {
      pollfd p{fd, POLLIN, 0};
      ::poll(&p, 1, 100);
      continue;
    }
    len += static_cast<size_t>(*r);
    size_t at = 0;
    while (len - at >= kFrameHeaderBytes) {
      auto h = decode_header(ByteView(rx.data() + at, kFrameHeaderBytes));
      if (!h.ok()) {
        ADD_FAILURE() << h.status().message();
        return frames;
      }
      if (len - at - kFrameHeaderBytes < h->body_bytes) break;
      frames.emplace_back(
          h->op, Bytes(rx.begin() + static_cast<long>(at + kFrameHeaderBytes),
                       rx.begin() + static_cast<long>(at + kFrameHeaderBytes + h->body_bytes)));
      at += kFrameHeaderBytes + h->body_bytes;
    }
    std::memmove(rx.data(), rx.data() + at, len - at);
    len -= at;
  }
  return frames;
}

// A batch of 5000 blocks is two COPY_REQs, the first of 4096 segments
// (295 KB), larger than a Unix socket's send buffer (208 KiB by default). On
// the O_NONBLOCK socket the transport used to send on, sendmsg wrote part of
// it and then failed with EAGAIN: the target waited for the rest of a frame
// that never came whole, and the write never completed. Prepared as the
// transport prepares its sockets, every frame crosses whole, in order.
TEST(CudaIpcWire, FramesLargerThanTheSocketBufferCrossWhole) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
  // The default buffer (Linux doubles what is asked: 208 KiB), whatever this
  // host's net.core.wmem_default says.
  int sndbuf = 104 << 10;
  ASSERT_EQ(::setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf), 0);
  socklen_t n = sizeof sndbuf;
  ASSERT_EQ(::getsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, &n), 0);
  const Bytes first = encode_copy_request(SampleRequest(kMaxCopySegments, false));
  ASSERT_GT(first.size(), static_cast<size_t>(sndbuf)) << "the test needs a frame over the buffer";

  // The cause: an O_NONBLOCK socket nobody drains at that moment refuses the
  // rest of the frame at once (the send timeout does not apply).
  unix_socket::set_send_timeout(sv[0], std::chrono::milliseconds(2000));
  Status s = unix_socket::send_all(sv[0], first);
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
  ::close(sv[0]);
  ::close(sv[1]);

  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
  sndbuf = 104 << 10;
  ASSERT_EQ(::setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf), 0);
  for (int fd : sv) {
    ASSERT_TRUE(prepare_control_socket(fd).ok());
    unix_socket::set_send_timeout(fd, std::chrono::milliseconds(5000));
  }
  CopyRequest with_notification = SampleRequest(kMaxCopySegments, true);
  with_notification.notification.assign(kMaxNotificationBytes, 0x6b);
  const Bytes second = encode_copy_request(with_notification);
  const Bytes third = encode_copy_request(SampleRequest(5000 - kMaxCopySegments, false));
  const Bytes notify = encode_notify(ByteView(with_notification.notification));
  std::vector<std::pair<Op, Bytes>> got;
  // The reader starts late: the sender must wait for it, not give up.
  std::thread reader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    got = ReceiveFrames(sv[1], 4);
  });
  for (const Bytes* f : {&first, &second, &third, &notify}) {
    Status sent = unix_socket::send_all(sv[0], *f);
    EXPECT_TRUE(sent.ok()) << sent.to_string();
  }
  reader.join();
  ::close(sv[0]);
  ::close(sv[1]);
  ASSERT_EQ(got.size(), 4u);
  const Bytes* sent[] = {&first, &second, &third, &notify};
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].second.size() + kFrameHeaderBytes, sent[i]->size());
    EXPECT_TRUE(std::equal(got[i].second.begin(), got[i].second.end(),
                           sent[i]->begin() + kFrameHeaderBytes));
  }
  auto q = decode_copy_request(ByteView(got[0].second));
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_EQ(q->segments.size(), kMaxCopySegments);
  q = decode_copy_request(ByteView(got[1].second));
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_EQ(q->notification.size(), kMaxNotificationBytes);
  q = decode_copy_request(ByteView(got[2].second));
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_EQ(q->segments.size(), 5000 - kMaxCopySegments);
  EXPECT_EQ(got[3].first, Op::kNotify);
}

// The address names each GPU by UUID and PCI bus id (format 2); an older
// build's address (format 1, UUIDs only) is still read, its PCI ids unknown.
TEST(CudaIpcAddress, NamesGpusByUuidAndPciBusIdAndReadsFormat1) {
  Address a;
  a.socket_path = "/tmp/ferry-ipc-test.sock";
  a.pid = 4242;
  for (uint8_t i = 0; i < 3; ++i) {
    std::array<uint8_t, kUuidBytes> u{};
    for (size_t k = 0; k < u.size(); ++k) u[k] = static_cast<uint8_t>(17 * i + k);
    a.gpus.push_back(u);
    a.gpu_pci.push_back(pack_pci_bus_id(0, 0x18 + 0x10 * i, 0, 0));
  }
  const Bytes b = encode_address(a);
  ASSERT_EQ(b[0], kAddressFormat);
  GuardedBuffer g(b);
  auto back = decode_address(g.span());
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->socket_path, a.socket_path);
  EXPECT_EQ(back->pid, a.pid);
  EXPECT_EQ(back->gpus, a.gpus);
  EXPECT_EQ(back->gpu_pci, a.gpu_pci);
  EXPECT_EQ(gpu_text(*back, 1).substr(gpu_text(*back, 1).size() - 14), "(0000:28:00.0)");
  for (size_t n = 0; n < b.size(); ++n) {
    GuardedBuffer t(Bytes(b.begin(), b.begin() + static_cast<long>(n)));
    EXPECT_FALSE(decode_address(t.span()).ok()) << "accepted an address cut to " << n << " bytes";
  }

  // Format 1 as an older build writes it: no PCI bus id after each UUID.
  Bytes old;
  old.push_back(kAddressFormatUuidOnly);
  old.push_back(0);
  const uint16_t path = static_cast<uint16_t>(a.socket_path.size());
  old.push_back(static_cast<uint8_t>(path));
  old.push_back(static_cast<uint8_t>(path >> 8));
  for (int k = 0; k < 4; ++k) old.push_back(static_cast<uint8_t>(a.pid >> (8 * k)));
  old.push_back(3);
  old.push_back(0);
  old.push_back(0);
  old.push_back(0);
  for (const auto& u : a.gpus) old.insert(old.end(), u.begin(), u.end());
  old.insert(old.end(), a.socket_path.begin(), a.socket_path.end());
  GuardedBuffer o(old);
  auto v1 = decode_address(o.span());
  ASSERT_TRUE(v1.ok()) << v1.status().message();
  EXPECT_EQ(v1->gpus, a.gpus);
  EXPECT_EQ(v1->gpu_pci, std::vector<uint32_t>(3, 0));
  EXPECT_EQ(gpu_text(*v1, 0), uuid_text(a.gpus[0]));

  Bytes future = b;
  future[0] = 3;
  GuardedBuffer f(future);
  auto r = decode_address(f.span());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("format 3"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace ferry::cuda_ipc
