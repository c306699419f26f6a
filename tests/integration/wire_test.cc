// Malformed input on the wire (issue 2 item 5, DESIGN.md §3), spoken with a
// plain TCP socket to a ferry_test_peer's listen port using the layout in
// src/transport/tcp/tcp_wire.h. After every case the target process is alive,
// serves a legitimate engine (over its existing connection and a new one),
// and its memory is unchanged (checksum of all of it).
//
// Also here: target-side validation reached directly with raw frames that
// carry a genuine key (which the public API cannot produce, because the
// initiator checks the range first), and the connecting side facing a fake
// server (wrong version, silence, garbage).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <random>

#include "core/metadata.h"
#include "fixture.h"
#include "raw_conn.h"
#include "transport/tcp/tcp_wire.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;
using namespace ferry::tcp;
using Clock = std::chrono::steady_clock;

FrameHeader MakeHeader(Op op, uint32_t count, uint64_t payload, uint32_t aux, TransferId id = 1) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.op = static_cast<uint8_t>(op);
  h.count = count;
  h.transfer_id = id;
  h.payload_bytes = payload;
  h.aux_bytes = aux;
  return h;
}

WireSegment Segment(const RemoteDescriptor& d, uint64_t offset, uint64_t length) {
  WireSegment w{};
  w.region_id = d.region_id;
  w.adv_offset = d.region_offset;
  w.adv_length = d.length;
  w.key = d.key;
  w.offset = offset;
  w.length = length;
  w.access = d.access;
  return w;
}

Bytes Frame(const FrameHeader& h, const void* aux, size_t aux_len, const Bytes& payload = {}) {
  Bytes out(sizeof h + aux_len + payload.size());
  std::memcpy(out.data(), &h, sizeof h);
  if (aux_len > 0) std::memcpy(out.data() + sizeof h, aux, aux_len);
  if (!payload.empty())
    std::memcpy(out.data() + sizeof h + aux_len, payload.data(), payload.size());
  return out;
}

Bytes WriteFrame(const std::vector<WireSegment>& segs, const Bytes& payload, TransferId id = 1) {
  const auto h = MakeHeader(Op::kWrite, static_cast<uint32_t>(segs.size()), payload.size(),
                            static_cast<uint32_t>(segs.size() * sizeof(WireSegment)), id);
  return Frame(h, segs.data(), segs.size() * sizeof(WireSegment), payload);
}

Bytes ReadFrame(const std::vector<WireSegment>& segs, TransferId id = 1) {
  const auto h = MakeHeader(Op::kReadRequest, static_cast<uint32_t>(segs.size()), 0,
                            static_cast<uint32_t>(segs.size() * sizeof(WireSegment)), id);
  return Frame(h, segs.data(), segs.size() * sizeof(WireSegment));
}

struct Response {
  FrameHeader header{};
  std::string message;
  Bytes payload;
};

std::optional<Response> ReadResponse(RawConn& c) {
  Response r;
  if (!c.RecvExact(&r.header, sizeof r.header, 10s)) return std::nullopt;
  if (r.header.magic != kFrameMagic || r.header.aux_bytes > 65536 ||
      r.header.payload_bytes > (64 << 20)) {
    return std::nullopt;
  }
  r.message.resize(r.header.aux_bytes);
  if (!c.RecvExact(r.message.data(), r.message.size(), 10s)) return std::nullopt;
  r.payload.resize(r.header.payload_bytes);
  if (!c.RecvExact(r.payload.data(), r.payload.size(), 10s)) return std::nullopt;
  return r;
}

class WireTest : public ::testing::Test {
 protected:
  void SetUp() override {
    peer_ = StartPeer(
        {.size = kSize, .seed = kSeed, .engine_options = {"tcp.connect_timeout_ms=1000"}});
    ASSERT_TRUE(peer_);
    engine_ = MakeEngine();
    ASSERT_TRUE(engine_);
    auto p = engine_->connect(ByteView(peer_->metadata));
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    local_ = std::make_unique<LocalBuffer>(*engine_, kSize);
    original_ = PatternHash(kSeed, 0, kSize);
  }
  void TearDown() override {
    if (peer_ && !HasFatalFailure()) ExpectHealthyAndUnchanged("at the end");
  }

  // A completed handshake as engine `id` (one stream); the reply is checked.
  std::unique_ptr<RawConn> Handshaken(uint64_t id = 0x1234567890ABCDEFull) {
    auto c = std::make_unique<RawConn>(peer_->listen);
    EXPECT_TRUE(c->ok()) << "cannot connect to " << peer_->listen;
    if (!c->ok()) return nullptr;
    Hello h = MakeHello(id);
    EXPECT_TRUE(c->Send(&h, sizeof h));
    HelloReply reply{};
    EXPECT_TRUE(c->RecvExact(&reply, sizeof reply, 10s)) << "no handshake reply";
    EXPECT_EQ(reply.magic, kHelloMagic);
    EXPECT_EQ(reply.status, 0) << "handshake refused";
    EXPECT_EQ(reply.engine_id, peer_->engine_id);
    EXPECT_EQ(reply.protocol_version, kProtocolVersion);
    return c;
  }

  // The target still works for a real engine, and nothing was written.
  void ExpectHealthyAndUnchanged(const std::string& when) {
    SCOPED_TRACE(when);
    ASSERT_TRUE(peer_->Alive()) << "the target process died or hangs";
    EXPECT_EQ(peer_->Checksum(0, kSize), original_) << "target memory changed";
    // The existing connection: read, and write the very bytes that are there.
    LocalIov l{local_->data(), 65536};
    RemoteIov r{&peer_->rw, 4096, 65536};
    std::memset(local_->data(), 0, 65536);
    Status s = engine_->read(peer_->engine_id, {&l, 1}, {&r, 1}, 30s);
    ASSERT_TRUE(s.ok()) << "existing connection, read: " << s.to_string();
    EXPECT_TRUE(MatchesPattern(kSeed, 4096, local_->data(), 65536));
    s = engine_->write(peer_->engine_id, {&l, 1}, {&r, 1}, std::nullopt, 30s);
    ASSERT_TRUE(s.ok()) << "existing connection, write: " << s.to_string();
    // A new engine connecting now.
    auto fresh = MakeEngine();
    ASSERT_TRUE(fresh);
    auto p = fresh->connect(ByteView(peer_->metadata));
    ASSERT_TRUE(p.ok()) << "new connection: " << p.status().to_string();
    Buffer buf(4096);
    ASSERT_TRUE(fresh->register_memory(buf.data(), 4096).ok());
    LocalIov fl{buf.data(), 4096};
    RemoteIov fr{&peer_->ro, 8192, 4096};
    s = fresh->read(*p, {&fl, 1}, {&fr, 1}, 30s);
    ASSERT_TRUE(s.ok()) << "new connection, read: " << s.to_string();
    EXPECT_TRUE(MatchesPattern(kSeed, 8192, buf.data(), 4096));
    EXPECT_EQ(peer_->Checksum(0, kSize), original_) << "target memory changed";
  }

  void ExpectClosed(RawConn& c, const std::string& what) {
    EXPECT_TRUE(c.ClosedByPeer(5s)) << what << ": the engine kept the connection open";
    ExpectHealthyAndUnchanged("after " + what);
  }

  static constexpr uint64_t kSize = 1 << 20;
  static constexpr uint64_t kSeed = 66;
  std::unique_ptr<TestPeer> peer_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<LocalBuffer> local_;
  uint64_t original_ = 0;
};

// --- before or during the handshake -----------------------------------------

TEST_F(WireTest, GarbageOnTheListenPort) {
  std::mt19937_64 rng(1);
  for (size_t len : {size_t{32}, size_t{33}, size_t{4096}, size_t{100000}}) {
    RawConn c(peer_->listen);
    ASSERT_TRUE(c.ok());
    Bytes junk(len);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    c.Send(junk);  // the engine may close before all of it is sent
    ExpectClosed(c, std::to_string(len) + " bytes of garbage");
  }
}

TEST_F(WireTest, HttpRequestOnTheListenPort) {
  RawConn c(peer_->listen);
  ASSERT_TRUE(c.ok());
  const std::string get =
      "GET / HTTP/1.1\r\nHost: localhost\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\n\r\n";
  c.Send(get.data(), get.size());
  ExpectClosed(c, "an HTTP request");
}

TEST_F(WireTest, IncompleteHandshakeIsClosedAfterTheHandshakeTimeout) {
  // Fewer bytes than a Hello and then silence: the target allows
  // tcp.connect_timeout_ms ("time allowed for connecting and the handshake",
  // 1000 ms here) and then closes, rather than holding the socket forever.
  Hello h = MakeHello(82);
  const size_t sent[] = {0, 1, sizeof(Hello) - 1};
  std::vector<std::unique_ptr<RawConn>> conns;
  for (size_t n : sent) {
    conns.push_back(std::make_unique<RawConn>(peer_->listen));
    ASSERT_TRUE(conns.back()->ok());
    if (n > 0) {
      ASSERT_TRUE(conns.back()->Send(&h, n));
    }
  }
  const auto t0 = Clock::now();
  const auto deadline = t0 + 4s;
  for (size_t i = 0; i < conns.size(); ++i) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    EXPECT_TRUE(conns[i]->ClosedByPeer(std::max(left, 1ms)))
        << "a connection that sent " << sent[i] << " of " << sizeof(Hello)
        << " handshake bytes was still open after 4 s (handshake timeout 1 s)";
  }
  EXPECT_GT(Clock::now() - t0, 500ms) << "closed before the handshake timeout";
  ExpectHealthyAndUnchanged("after stalled handshakes");
}

TEST_F(WireTest, TruncatedHandshakeThenClose) {
  Hello h = MakeHello(77);
  for (size_t n : {size_t{1}, size_t{4}, size_t{10}, sizeof(Hello) - 1}) {
    RawConn c(peer_->listen);
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE(c.Send(&h, n));
    c.Close();
    ExpectHealthyAndUnchanged("handshake cut after " + std::to_string(n) + " bytes");
  }
}

TEST_F(WireTest, TruncatedHandshakeLeftOpenDoesNotBlockOthers) {
  std::vector<std::unique_ptr<RawConn>> stalled;
  Hello h = MakeHello(78);
  for (int i = 0; i < 8; ++i) {
    stalled.push_back(std::make_unique<RawConn>(peer_->listen));
    ASSERT_TRUE(stalled.back()->ok());
    ASSERT_TRUE(stalled.back()->Send(&h, 10));
  }
  ExpectHealthyAndUnchanged("with 8 half-open handshakes pending");
}

TEST_F(WireTest, WrongHandshakeMagic) {
  for (uint32_t magic : {kHelloMagic ^ 1u, 0u, 0xFFFFFFFFu, uint32_t{kFrameMagic}}) {
    RawConn c(peer_->listen);
    ASSERT_TRUE(c.ok());
    Hello h = MakeHello(79);
    h.magic = magic;
    ASSERT_TRUE(c.Send(&h, sizeof h));
    ExpectClosed(c, "handshake magic " + std::to_string(magic));
  }
}

TEST_F(WireTest, WrongProtocolVersionIsRefusedNamingBothVersions) {
  for (uint16_t v : {uint16_t(kProtocolVersion + 1), uint16_t{0}, uint16_t{0xFFFF}}) {
    RawConn c(peer_->listen);
    ASSERT_TRUE(c.ok());
    Hello h = MakeHello(80);
    h.protocol_version = v;
    ASSERT_TRUE(c.Send(&h, sizeof h));
    HelloReply reply{};
    ASSERT_TRUE(c.RecvExact(&reply, sizeof reply, 10s)) << "no refusal for version " << v;
    EXPECT_EQ(reply.magic, kHelloMagic);
    EXPECT_EQ(reply.status, static_cast<uint16_t>(StatusCode::kProtocolError));
    ASSERT_GT(reply.message_bytes, 0u);
    ASSERT_LE(reply.message_bytes, kMaxHelloMessage);
    std::string msg(reply.message_bytes, '\0');
    ASSERT_TRUE(c.RecvExact(msg.data(), msg.size(), 10s));
    const Status as_status(StatusCode::kProtocolError, msg);
    EXPECT_TRUE(NamesNumber(as_status, v)) << "peer's version missing";
    EXPECT_TRUE(NamesNumber(as_status, kProtocolVersion)) << "engine's version missing";
    ExpectClosed(c, "protocol version " + std::to_string(v));
  }
}

TEST_F(WireTest, MalformedHandshakeFields) {
  struct Case {
    const char* what;
    void (*apply)(Hello&);
  } cases[] = {
      {"engine id 0", [](Hello& h) { h.engine_id = 0; }},
      {"stream count 0", [](Hello& h) { h.stream_count = 0; }},
      {"stream index beyond count",
       [](Hello& h) {
         h.stream_index = 5;
         h.stream_count = 2;
       }},
      {"65535 streams", [](Hello& h) { h.stream_count = 0xFFFF; }},
  };
  for (const auto& k : cases) {
    RawConn c(peer_->listen);
    ASSERT_TRUE(c.ok());
    Hello h = MakeHello(81);
    k.apply(h);
    ASSERT_TRUE(c.Send(&h, sizeof h));
    HelloReply reply{};
    if (c.RecvExact(&reply, sizeof reply, 10s)) {
      EXPECT_NE(reply.status, 0) << k.what << " was accepted";
    }
    ExpectClosed(c, k.what);
  }
}

TEST_F(WireTest, ManyGarbageConnections) {
  for (int i = 0; i < 100; ++i) {
    RawConn c(peer_->listen);
    ASSERT_TRUE(c.ok()) << "connection " << i << " refused: the listener stopped accepting";
    const char junk[] = "\x00\x01garbage\xff";
    c.Send(junk, sizeof junk);
  }
  ExpectHealthyAndUnchanged("after 100 garbage connections");
}

// --- after a valid handshake -------------------------------------------------

TEST_F(WireTest, GarbageAfterHandshake) {
  auto c = Handshaken();
  ASSERT_TRUE(c);
  Bytes junk(4096);
  std::mt19937_64 rng(2);
  for (auto& b : junk) b = static_cast<uint8_t>(rng());
  c->Send(junk);
  ExpectClosed(*c, "garbage after the handshake");
}

TEST_F(WireTest, UnknownOpcodes) {
  for (uint8_t op : {uint8_t{0}, uint8_t{7}, uint8_t{0x7F}, uint8_t{0xFF}}) {
    auto c = Handshaken();
    ASSERT_TRUE(c);
    FrameHeader h = MakeHeader(static_cast<Op>(op), 0, 0, 0);
    ASSERT_TRUE(c->Send(&h, sizeof h));
    ExpectClosed(*c, "opcode " + std::to_string(op));
  }
}

TEST_F(WireTest, BadFrameMagic) {
  auto c = Handshaken();
  ASSERT_TRUE(c);
  WireSegment seg = Segment(peer_->rw, 0, 16);
  FrameHeader h = MakeHeader(Op::kWrite, 1, 16, sizeof seg);
  h.magic ^= 0x0101;
  Bytes f = Frame(h, &seg, sizeof seg, Bytes(16, 0x42));
  c->Send(f);
  ExpectClosed(*c, "bad frame magic");
}

TEST_F(WireTest, ImpossibleLengths) {
  const WireSegment seg = Segment(peer_->rw, 0, 16);
  struct Case {
    const char* what;
    FrameHeader header;
  } cases[] = {
      {"WRITE with 0 segments", MakeHeader(Op::kWrite, 0, 16, 0)},
      {"WRITE with too many segments",
       MakeHeader(Op::kWrite, kMaxSegmentsPerFrame + 1, 16,
                  (kMaxSegmentsPerFrame + 1) * sizeof(WireSegment))},
      {"WRITE with 4 billion segments", MakeHeader(Op::kWrite, 0xFFFFFFFF, 16, 0xFFFFFFC8)},
      {"WRITE whose aux is not its segment table", MakeHeader(Op::kWrite, 1, 16, 55)},
      {"WRITE with a huge aux", MakeHeader(Op::kWrite, 1, 16, 0xFFFFFFFF)},
      {"WRITE payload beyond the frame limit",
       MakeHeader(Op::kWrite, 1, kMaxFramePayload + 1, sizeof(WireSegment))},
      {"WRITE payload of 2^64-1", MakeHeader(Op::kWrite, 1, ~uint64_t{0}, sizeof(WireSegment))},
      {"READ_REQUEST carrying payload", MakeHeader(Op::kReadRequest, 1, 16, sizeof(WireSegment))},
      {"NOTIFY beyond its limit", MakeHeader(Op::kNotify, 0, 0, kMaxNotificationBytes + 1)},
      {"NOTIFY with payload", MakeHeader(Op::kNotify, 0, 5, 0)},
      {"WRITE_ACK with a huge message", MakeHeader(Op::kWriteAck, 0, 0, 0x7FFFFFFF)},
      {"READ_RESPONSE with an impossible payload",
       MakeHeader(Op::kReadResponse, 0, ~uint64_t{0}, 0)},
  };
  for (const auto& k : cases) {
    auto c = Handshaken();
    ASSERT_TRUE(c);
    // Header plus one segment's worth of bytes: a decoder trusting the
    // lengths would wait for (or read) far more.
    Bytes f = Frame(k.header, &seg, sizeof seg);
    c->Send(f);
    ExpectClosed(*c, k.what);
  }
}

TEST_F(WireTest, SegmentTableInconsistentWithPayload) {
  struct Case {
    const char* what;
    std::vector<WireSegment> segs;
    uint64_t payload;
  } cases[] = {
      {"segments sum below payload", {Segment(peer_->rw, 0, 100)}, 200},
      {"segments sum above payload", {Segment(peer_->rw, 0, 300)}, 200},
      {"zero-length segment", {Segment(peer_->rw, 0, 0), Segment(peer_->rw, 0, 64)}, 64},
      {"segment lengths overflowing 64 bits",
       {Segment(peer_->rw, 0, ~uint64_t{0} - 10), Segment(peer_->rw, 0, 75)},
       64},
  };
  for (const auto& k : cases) {
    auto c = Handshaken();
    ASSERT_TRUE(c);
    FrameHeader h = MakeHeader(Op::kWrite, static_cast<uint32_t>(k.segs.size()), k.payload,
                               static_cast<uint32_t>(k.segs.size() * sizeof(WireSegment)));
    c->Send(Frame(h, k.segs.data(), k.segs.size() * sizeof(WireSegment), Bytes(k.payload, 0x33)));
    ExpectClosed(*c, k.what);
  }
}

TEST_F(WireTest, UnsolicitedResponses) {
  for (Op op : {Op::kWriteAck, Op::kNotifyAck, Op::kReadResponse}) {
    auto c = Handshaken();
    ASSERT_TRUE(c);
    FrameHeader h = MakeHeader(op, 0, 0, 0, 4242);
    ASSERT_TRUE(c->Send(&h, sizeof h));
    ExpectClosed(*c, std::string("unsolicited ") + op_name(static_cast<uint8_t>(op)));
  }
}

TEST_F(WireTest, TruncatedFrames) {
  WireSegment bad = Segment(peer_->rw, 0, 4096);
  bad.key ^= 1;  // refused: its payload is drained, never placed
  const Bytes full = WriteFrame({bad}, Bytes(4096, 0x99));
  for (size_t cut : {size_t{5}, sizeof(FrameHeader) - 1, sizeof(FrameHeader) + 20,
                     sizeof(FrameHeader) + sizeof(WireSegment) + 100, full.size() - 1}) {
    auto c = Handshaken();
    ASSERT_TRUE(c);
    ASSERT_TRUE(c->Send(full.data(), cut));
    c->Close();
    ExpectHealthyAndUnchanged("frame cut after " + std::to_string(cut) + " bytes");
  }
}

TEST_F(WireTest, TruncatedAuthorisedWriteStaysInsideItsRange) {
  // With a genuine key the target receives straight into the region, so a
  // frame cut short may leave part of its payload in the authorised range;
  // nothing may land outside it, and the engine keeps working.
  const uint64_t off = 200000, len = 65536;
  const Bytes full = WriteFrame({Segment(peer_->rw, off, len)}, Bytes(len, 0x77));
  auto c = Handshaken();
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Send(full.data(), full.size() - len / 2));
  c->Close();
  ASSERT_TRUE(peer_->Alive());
  EXPECT_EQ(peer_->Checksum(0, off), PatternHash(kSeed, 0, off));
  EXPECT_EQ(peer_->Checksum(off + len, kSize - off - len),
            PatternHash(kSeed, off + len, kSize - off - len));
  ASSERT_EQ(peer_->Command("fill " + std::to_string(kSeed) + " " + std::to_string(off) + " " +
                           std::to_string(len)),
            "OK");
}

// --- target-side validation with genuine keys -------------------------------

TEST_F(WireTest, RawClientSpeaksTheProtocol) {
  // Guards the refusal tests below: the same raw client can write and read.
  auto c = Handshaken();
  ASSERT_TRUE(c);
  Bytes data(1000);
  FillPattern(5, 0, data.data(), data.size());
  ASSERT_TRUE(c->Send(WriteFrame({Segment(peer_->rw, 300, 1000)}, data, 11)));
  auto ack = ReadResponse(*c);
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->header.op, static_cast<uint8_t>(Op::kWriteAck));
  EXPECT_EQ(ack->header.transfer_id, 11u);
  EXPECT_EQ(ack->header.status, 0u) << ack->message;
  EXPECT_EQ(peer_->Checksum(300, 1000), HashBytes(data.data(), data.size()));
  ASSERT_TRUE(
      c->Send(ReadFrame({Segment(peer_->rw, 300, 1000), Segment(peer_->ro, 5000, 24)}, 12)));
  auto resp = ReadResponse(*c);
  ASSERT_TRUE(resp.has_value());
  EXPECT_EQ(resp->header.op, static_cast<uint8_t>(Op::kReadResponse));
  EXPECT_EQ(resp->header.status, 0u) << resp->message;
  ASSERT_EQ(resp->payload.size(), 1024u);
  EXPECT_EQ(Bytes(resp->payload.begin(), resp->payload.begin() + 1000), data);
  EXPECT_TRUE(MatchesPattern(kSeed, 5000, resp->payload.data() + 1000, 24));
  ASSERT_EQ(peer_->Command("fill " + std::to_string(kSeed) + " 300 1000"), "OK");
}

TEST_F(WireTest, TargetRefusesWithGenuineKeys) {
  auto c = Handshaken();
  ASSERT_TRUE(c);
  const RemoteDescriptor& rw = peer_->rw;
  const RemoteDescriptor& sub = peer_->sub;
  WireSegment wrong_key = Segment(rw, 0, 64);
  wrong_key.key ^= 1;
  WireSegment unknown = Segment(rw, 0, 64);
  unknown.region_id += 99;
  WireSegment upgraded = Segment(peer_->ro, 0, 64);
  upgraded.access = kAccessReadWrite;
  WireSegment widened = Segment(sub, 0, 64);
  widened.adv_length += 1;
  struct Case {
    const char* what;
    WireSegment seg;
    StatusCode code;
  } writes[] = {
      {"op past the advertised end", Segment(sub, sub.length - 10, 20), StatusCode::kOutOfRange},
      {"op starting at the advertised end", Segment(sub, sub.length, 8), StatusCode::kOutOfRange},
      {"offset near 2^64 (wraps)", Segment(sub, ~uint64_t{0} - 5, 16), StatusCode::kOutOfRange},
      {"offset 2^63", Segment(rw, uint64_t{1} << 63, 16), StatusCode::kOutOfRange},
      {"op past the region end", Segment(rw, kSize - 8, 16), StatusCode::kOutOfRange},
      {"wrong key", wrong_key, StatusCode::kPermissionDenied},
      {"unknown region", unknown, StatusCode::kNotFound},
      {"write through read-only", Segment(peer_->ro, 0, 64), StatusCode::kPermissionDenied},
      {"read-only upgraded to read-write", upgraded, StatusCode::kPermissionDenied},
      {"advertised range widened", widened, StatusCode::kPermissionDenied},
  };
  TransferId id = 100;
  for (const auto& k : writes) {
    ++id;
    // One valid segment first, then the bad one: nothing of the frame lands.
    const WireSegment good = Segment(rw, 500000, 32);
    ASSERT_TRUE(c->Send(WriteFrame({good, k.seg}, Bytes(32 + k.seg.length, 0xC3), id)));
    auto ack = ReadResponse(*c);
    ASSERT_TRUE(ack.has_value()) << k.what << ": no WRITE_ACK (connection closed?)";
    EXPECT_EQ(ack->header.op, static_cast<uint8_t>(Op::kWriteAck)) << k.what;
    EXPECT_EQ(ack->header.transfer_id, id) << k.what;
    EXPECT_EQ(ack->header.status, static_cast<uint32_t>(k.code)) << k.what << ": " << ack->message;
    EXPECT_TRUE(NamesRegion(Status(k.code, ack->message), k.seg.region_id)) << k.what;
    if (k.code == StatusCode::kOutOfRange) {
      EXPECT_TRUE(NamesNumber(Status(k.code, ack->message), k.seg.offset)) << k.what;
    }
    EXPECT_EQ(peer_->Checksum(0, kSize), original_) << k.what << ": memory changed";
  }
  struct ReadCase {
    const char* what;
    WireSegment seg;
    StatusCode code;
  } reads[] = {
      {"read past the advertised end", Segment(sub, sub.length - 1, 2), StatusCode::kOutOfRange},
      {"read at offset near 2^64", Segment(rw, ~uint64_t{0}, 1), StatusCode::kOutOfRange},
      {"read through write-only", Segment(peer_->wo, 0, 64), StatusCode::kPermissionDenied},
      {"read with a wrong key", wrong_key, StatusCode::kPermissionDenied},
      {"read of an unknown region", unknown, StatusCode::kNotFound},
  };
  for (const auto& k : reads) {
    ++id;
    ASSERT_TRUE(c->Send(ReadFrame({k.seg}, id)));
    auto resp = ReadResponse(*c);
    ASSERT_TRUE(resp.has_value()) << k.what << ": no READ_RESPONSE (connection closed?)";
    EXPECT_EQ(resp->header.op, static_cast<uint8_t>(Op::kReadResponse)) << k.what;
    EXPECT_EQ(resp->header.status, static_cast<uint32_t>(k.code))
        << k.what << ": " << resp->message;
    EXPECT_TRUE(resp->payload.empty()) << k.what << ": refused read returned data";
    EXPECT_TRUE(NamesRegion(Status(k.code, resp->message), k.seg.region_id)) << k.what;
  }
  // A refusal is not a protocol error: the connection still carries requests.
  ASSERT_TRUE(c->Send(ReadFrame({Segment(rw, 0, 8)}, ++id)));
  auto last = ReadResponse(*c);
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->header.status, 0u);
}

TEST_F(WireTest, TargetRefusesAfterDeregistration) {
  auto c = Handshaken();
  ASSERT_TRUE(c);
  ASSERT_EQ(peer_->Command("dereg"), "OK");
  ASSERT_TRUE(c->Send(WriteFrame({Segment(peer_->rw, 0, 64)}, Bytes(64, 1), 7)));
  auto ack = ReadResponse(*c);
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->header.status, static_cast<uint32_t>(StatusCode::kNotFound)) << ack->message;
  EXPECT_TRUE(NamesRegion(Status(StatusCode::kNotFound, ack->message), peer_->region));
  EXPECT_EQ(peer_->Checksum(0, kSize), original_);
  // The fixture's health check needs a registered region: use a fresh peer.
  peer_.reset();
}

// Deregistration must not wait for a peer that stopped mid-frame: a WRITE
// whose sender stalls after half its payload holds the region while the
// bytes arrive. deregister_memory() returns at once, and what arrives after
// it is discarded, not placed; the writer gets NotFound naming the region.
TEST_F(WireTest, DeregistrationDoesNotWaitForAStalledWriter) {
  auto c = Handshaken();
  ASSERT_TRUE(c);
  constexpr uint64_t kOff = 64 << 10, kLen = 512 << 10, kHalf = kLen / 2;
  constexpr uint64_t kPayloadSeed = 777;
  Bytes payload(kLen);
  FillPattern(kPayloadSeed, kOff, payload.data(), kLen);
  const Bytes frame = WriteFrame({Segment(peer_->rw, kOff, kLen)}, payload, 9);
  const size_t head = frame.size() - kLen;
  ASSERT_TRUE(c->Send(frame.data(), head + kHalf));
  std::this_thread::sleep_for(300ms);  // the target takes the first half in, then waits
  const auto t0 = Clock::now();
  ASSERT_EQ(peer_->Command("dereg", 5s), "OK") << "deregistration waited for the stalled writer";
  EXPECT_LT(Clock::now() - t0, 2s);
  // The half that arrived before was placed; nothing sent after is.
  EXPECT_EQ(peer_->Checksum(kOff, kHalf), PatternHash(kPayloadSeed, kOff, kHalf));
  ASSERT_TRUE(c->Send(frame.data() + head + kHalf, kLen - kHalf));
  auto ack = ReadResponse(*c);
  ASSERT_TRUE(ack.has_value()) << "no WRITE_ACK after the rest arrived";
  EXPECT_EQ(ack->header.op, static_cast<uint8_t>(Op::kWriteAck));
  EXPECT_EQ(ack->header.transfer_id, 9u);
  EXPECT_EQ(ack->header.status, static_cast<uint32_t>(StatusCode::kNotFound)) << ack->message;
  EXPECT_NE(ack->message.find("deregistered"), std::string::npos) << ack->message;
  EXPECT_NE(ack->message.find(std::to_string(kHalf) + " of this frame's " + std::to_string(kLen)),
            std::string::npos)
      << ack->message;
  EXPECT_TRUE(NamesRegion(Status(StatusCode::kNotFound, ack->message), peer_->region));
  EXPECT_EQ(peer_->Checksum(kOff + kHalf, kLen - kHalf),
            PatternHash(kSeed, kOff + kHalf, kLen - kHalf))
      << "bytes that arrived after deregistration were written";
  EXPECT_EQ(peer_->Checksum(0, kOff), PatternHash(kSeed, 0, kOff));
  EXPECT_EQ(peer_->Checksum(kOff + kLen, kSize - kOff - kLen),
            PatternHash(kSeed, kOff + kLen, kSize - kOff - kLen));
  // The connection still carries requests (now refused: the region is gone).
  ASSERT_TRUE(c->Send(ReadFrame({Segment(peer_->rw, 0, 8)}, 10)));
  auto resp = ReadResponse(*c);
  ASSERT_TRUE(resp.has_value());
  EXPECT_EQ(resp->header.status, static_cast<uint32_t>(StatusCode::kNotFound)) << resp->message;
  EXPECT_TRUE(peer_->Alive());
  peer_.reset();  // the fixture's health check needs a registered region
}

// The same for a reader that stops reading: the response already on the wire
// is finished from a copy taken at deregistration (so the memory may be reused
// at once), and a response not started yet becomes NotFound.
TEST(WireRevocation, DeregistrationDoesNotWaitForAStalledReader) {
  constexpr uint64_t kSize = 64ull << 20, kSeed = 31;
  auto peer = StartPeer({.size = kSize, .seed = kSeed});
  ASSERT_TRUE(peer);
  RawConn c(peer->listen);
  ASSERT_TRUE(c.ok());
  Hello h = MakeHello(0x5151515151515151ull);
  ASSERT_TRUE(c.Send(&h, sizeof h));
  HelloReply reply{};
  ASSERT_TRUE(c.RecvExact(&reply, sizeof reply, 10s));
  ASSERT_EQ(reply.status, 0);
  // Two reads; this side reads nothing until the target's buffers are full.
  ASSERT_TRUE(c.Send(ReadFrame({Segment(peer->rw, 0, kSize)}, 21)));
  ASSERT_TRUE(c.Send(ReadFrame({Segment(peer->rw, 4096, 4096)}, 22)));
  std::this_thread::sleep_for(500ms);
  const auto t0 = Clock::now();
  ASSERT_EQ(peer->Command("dereg", 5s), "OK") << "deregistration waited for the stalled reader";
  EXPECT_LT(Clock::now() - t0, 2s);
  ASSERT_EQ(peer->Command("fill 99 0 " + std::to_string(kSize)), "OK");  // memory reused
  auto first = ReadResponse(c);
  ASSERT_TRUE(first.has_value()) << "the response on the wire was not finished";
  EXPECT_EQ(first->header.transfer_id, 21u);
  EXPECT_EQ(first->header.status, 0u) << first->message;
  ASSERT_EQ(first->payload.size(), kSize);
  EXPECT_TRUE(MatchesPattern(kSeed, 0, first->payload.data(), kSize))
      << "the read returned bytes written after deregistration";
  auto second = ReadResponse(c);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->header.transfer_id, 22u);
  EXPECT_EQ(second->header.status, static_cast<uint32_t>(StatusCode::kNotFound)) << second->message;
  EXPECT_NE(second->message.find("deregistered"), std::string::npos) << second->message;
  EXPECT_TRUE(second->payload.empty());
  EXPECT_TRUE(peer->Alive());
}

// --- the connecting side facing a fake server -------------------------------

// Listens on loopback and answers each connection with `behaviour`.
class FakeServer {
 public:
  explicit FakeServer(std::function<void(int fd)> behaviour) : behaviour_(std::move(behaviour)) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
    socklen_t len = sizeof sa;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    port_ = ntohs(sa.sin_port);
    listen(fd_, 16);
    thread_ = std::thread([this] {
      for (;;) {
        const int c = accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        behaviour_(c);
        conns_.push_back(c);
      }
    });
  }
  ~FakeServer() {
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
    for (int c : conns_) ::close(c);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  std::function<void(int)> behaviour_;
  int fd_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
  std::vector<int> conns_;
};

void ReadHello(int fd) {
  Hello h;
  size_t got = 0;
  while (got < sizeof h) {
    const ssize_t r = recv(fd, reinterpret_cast<char*>(&h) + got, sizeof h - got, 0);
    if (r <= 0) return;
    got += static_cast<size_t>(r);
  }
}

TEST(WireConnect, ServerSpeakingAnotherVersion) {
  const uint16_t theirs = kProtocolVersion + 1;
  FakeServer server([&](int fd) {
    ReadHello(fd);
    HelloReply r{kHelloMagic, theirs, 0, 0xABCDEF, 0, 0};
    (void)!send(fd, &r, sizeof r, MSG_NOSIGNAL);
  });
  auto e = MakeEngine({{"tcp.connect_timeout_ms", "2000"}});
  ASSERT_TRUE(e);
  const auto t0 = Clock::now();
  auto p = e->connect(std::string_view(server.address()));
  ASSERT_FALSE(p.ok()) << "connected to an engine speaking protocol " << theirs;
  EXPECT_EQ(p.status().code(), StatusCode::kProtocolError) << p.status().to_string();
  EXPECT_TRUE(NamesNumber(p.status(), theirs));
  EXPECT_TRUE(NamesNumber(p.status(), kProtocolVersion));
  EXPECT_LT(Clock::now() - t0, 2s) << "a version mismatch must fail at once, not time out";
}

TEST(WireConnect, ServerRefusingWithAMessage) {
  FakeServer server([&](int fd) {
    ReadHello(fd);
    const std::string why = "protocol version mismatch: peer speaks 1, this engine speaks 9";
    HelloReply r{kHelloMagic,
                 9,
                 static_cast<uint16_t>(StatusCode::kProtocolError),
                 0xABCDEF,
                 static_cast<uint32_t>(why.size()),
                 0};
    (void)!send(fd, &r, sizeof r, MSG_NOSIGNAL);
    (void)!send(fd, why.data(), why.size(), MSG_NOSIGNAL);
  });
  auto e = MakeEngine();
  ASSERT_TRUE(e);
  auto p = e->connect(std::string_view(server.address()));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kProtocolError) << p.status().to_string();
  EXPECT_NE(p.status().message().find("speaks 9"), std::string::npos) << p.status().to_string();
}

TEST(WireConnect, SilentServerTimesOut) {
  FakeServer server([](int) {});  // accepts, never answers
  auto e = MakeEngine({{"tcp.connect_timeout_ms", "500"}});
  ASSERT_TRUE(e);
  const auto t0 = Clock::now();
  auto p = e->connect(std::string_view(server.address()));
  const auto took = Clock::now() - t0;
  EXPECT_FALSE(p.ok()) << "connected to a server that never answered the handshake";
  EXPECT_LT(took, 5s) << "the handshake timeout (500 ms) was not applied";
}

TEST(WireConnect, GarbageAndClosingServers) {
  FakeServer garbage([](int fd) {
    ReadHello(fd);
    const char junk[64] = "this is not a ferry engine at all";
    (void)!send(fd, junk, sizeof junk, MSG_NOSIGNAL);
  });
  FakeServer closer([](int fd) { ::shutdown(fd, SHUT_RDWR); });
  auto e = MakeEngine({{"tcp.connect_timeout_ms", "2000"}});
  ASSERT_TRUE(e);
  auto g = e->connect(std::string_view(garbage.address()));
  EXPECT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kProtocolError) << g.status().to_string();
  auto c = e->connect(std::string_view(closer.address()));
  EXPECT_FALSE(c.ok());
  // The engine is still usable afterwards.
  auto peer = StartPeer({.size = 1 << 16, .seed = 3});
  ASSERT_TRUE(peer);
  auto ok = e->connect(ByteView(peer->metadata));
  EXPECT_TRUE(ok.ok()) << ok.status().to_string();
}

TEST(WireConnect, NothingListening) {
  // A port that was just free: connection refused, reported at once.
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  socklen_t len = sizeof sa;
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  auto e = MakeEngine();
  ASSERT_TRUE(e);
  const auto t0 = Clock::now();
  auto p = e->connect(std::string_view("127.0.0.1:" + std::to_string(ntohs(sa.sin_port))));
  EXPECT_FALSE(p.ok());
  EXPECT_NE(p.status().code(), StatusCode::kOk);
  EXPECT_LT(Clock::now() - t0, 2s);
}

TEST(WireConnect, MetadataWithAnotherProtocolVersion) {
  auto peer = StartPeer({.size = 1 << 16, .seed = 3});
  ASSERT_TRUE(peer);
  auto m = EngineMetadata::decode(peer->metadata);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  m->protocol_version = kProtocolVersion + 3;
  auto e = MakeEngine();
  ASSERT_TRUE(e);
  auto p = e->connect(ByteView(m->encode()));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kProtocolError) << p.status().to_string();
  EXPECT_TRUE(NamesNumber(p.status(), kProtocolVersion + 3));
  EXPECT_TRUE(NamesNumber(p.status(), kProtocolVersion));
}

TEST(WireConnect, CorruptMetadataIsRejected) {
  auto peer = StartPeer({.size = 1 << 16, .seed = 3});
  ASSERT_TRUE(peer);
  auto e = MakeEngine();
  ASSERT_TRUE(e);
  Bytes bad = peer->metadata;
  bad[bad.size() / 2] ^= 0x10;
  EXPECT_EQ(e->connect(ByteView(bad)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(e->connect(ByteView(Bytes{})).ok());
  EXPECT_FALSE(e->connect(std::string_view("no-port-here")).ok());
}

}  // namespace
}  // namespace ferry::itest
