// The stage trace over tcp between two real processes, host memory
// (docs/trace.md): with tcp.trace on, every transfer this engine initiates is
// logged with its stages present where they must be and in non-decreasing
// order, the target's stages included (carried back in the response's
// trailer; both processes share CLOCK_MONOTONIC). With it off nothing is
// logged and the frames are version 1's. The target's side of the trailer is
// also checked with raw frames: asked, it answers with one; not asked, its
// responses are byte for byte what they were before traces existed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <random>

#include "core/stage_trace.h"
#include "fixture.h"
#include "trace_expect.h"
#include "transport/tcp/tcp_wire.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;
using tracetest::check_tcp_record;
using tracetest::describe;

constexpr uint64_t kSize = 8 << 20;
constexpr uint64_t kSeed = 31;

class TraceTcp : public ::testing::Test {
 protected:
  void Start(bool trace) {
    peer_ = StartPeer({.size = kSize, .seed = kSeed, .engine_options = {"engine.transports=tcp"}});
    ASSERT_TRUE(peer_);
    engine_ = MakeEngine({{"engine.transports", "tcp"}, {"tcp.trace", trace ? "true" : "false"}});
    ASSERT_TRUE(engine_);
    auto p = engine_->connect(ByteView(peer_->metadata));
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    peer_id_ = *p;
    local_ = std::make_unique<LocalBuffer>(*engine_, kSize);
  }

  // Writes pattern `seed` from local [off, off+len) to the peer at `off` in
  // `iovs` pieces, blocking; checks the target's memory.
  void Write(uint64_t off, uint64_t len, size_t iovs, uint64_t seed) {
    FillPattern(seed, off, local_->data() + off, len);
    std::vector<LocalIov> l;
    std::vector<RemoteIov> r;
    Split(off, len, iovs, &l, &r);
    Status s = engine_->write(peer_id_, l, r, std::nullopt, 30s);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(peer_->Checksum(off, len), PatternHash(seed, off, len));
    ++transfers_;
  }
  void Read(uint64_t off, uint64_t len, size_t iovs, uint64_t seed) {
    std::memset(local_->data() + off, 0, len);
    std::vector<LocalIov> l;
    std::vector<RemoteIov> r;
    Split(off, len, iovs, &l, &r);
    Status s = engine_->read(peer_id_, l, r, 30s);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_TRUE(MatchesPattern(seed, off, local_->data() + off, len));
    ++transfers_;
  }
  void Split(uint64_t off, uint64_t len, size_t iovs, std::vector<LocalIov>* l,
             std::vector<RemoteIov>* r) {
    const uint64_t piece = len / iovs;
    for (size_t i = 0; i < iovs; ++i) {
      const uint64_t o = off + i * piece, n = i + 1 == iovs ? len - i * piece : piece;
      l->push_back({local_->data() + o, n});
      r->push_back({&peer_->rw, o, n});
    }
  }

  std::unique_ptr<TestPeer> peer_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<LocalBuffer> local_;
  PeerId peer_id_ = 0;
  size_t transfers_ = 0;
};

TEST_F(TraceTcp, WritesReadsAndNotificationsAreTracedInOrder) {
  ASSERT_NO_FATAL_FAILURE(Start(true));
  const std::vector<std::pair<uint64_t, size_t>> shapes = {
      {1, 1}, {4096, 1}, {65536, 1}, {262144, 1}, {65536, 16}, {1 << 20, 1}, {3 << 20, 5}};
  uint64_t seed = 100;
  for (auto [len, iovs] : shapes) {
    ASSERT_NO_FATAL_FAILURE(Write(0, len, iovs, ++seed));
    ASSERT_NO_FATAL_FAILURE(Read(0, len, iovs, seed));
  }
  // Eight in flight at once, writes then reads, on both streams.
  for (bool write : {true, false}) {
    std::vector<TransferId> ids;
    std::vector<LocalIov> l(8);
    std::vector<RemoteIov> r(8);
    for (size_t i = 0; i < 8; ++i) {
      l[i] = {local_->data() + i * 65536, 65536};
      r[i] = {&peer_->rw, i * 65536, 65536};
      auto id = write ? engine_->write_async(peer_id_, {&l[i], 1}, {&r[i], 1})
                      : engine_->read_async(peer_id_, {&l[i], 1}, {&r[i], 1});
      ASSERT_TRUE(id.ok()) << id.status().to_string();
      ids.push_back(*id);
    }
    for (TransferId id : ids) ASSERT_TRUE(engine_->wait(id, 30s).ok());
    transfers_ += 8;
  }
  // A write with a notification (its NOTIFY frame joins the write's trace),
  // and a standalone notification.
  {
    LocalIov l{local_->data(), 4096};
    RemoteIov r{&peer_->rw, 0, 4096};
    const Bytes note = {1, 2, 3};
    ASSERT_TRUE(engine_->write(peer_id_, {&l, 1}, {&r, 1}, ByteView(note), 30s).ok());
    ASSERT_TRUE(engine_->notify(peer_id_, ByteView(note)).ok());
    transfers_ += 2;
  }

  const auto records = take_engine_traces(engine_->id());
  ASSERT_EQ(records.size(), transfers_) << "one record per transfer initiated";
  size_t writes = 0, reads = 0, multi_frame = 0;
  for (const TraceRecord& r : records) {
    SCOPED_TRACE(describe(r));
    for (const auto& problem : check_tcp_record(r)) ADD_FAILURE() << problem;
    EXPECT_FALSE(r.local_gpu);
    EXPECT_FALSE(r.remote_gpu);
    writes += r.op == static_cast<uint8_t>(TransferOp::kWrite);
    reads += r.op == static_cast<uint8_t>(TransferOp::kRead);
    multi_frame += r.frames > 1;
  }
  EXPECT_EQ(writes, 7u + 8u + 1u);
  EXPECT_EQ(reads, 7u + 8u);
  EXPECT_GE(multi_frame, 4u) << "1 MiB and 3 MiB transfers are cut into several frames";
  // The last record is the standalone notification: posted, sent, answered.
  EXPECT_EQ(records.back().op, static_cast<uint8_t>(TransferOp::kNotify));
  EXPECT_TRUE(take_engine_traces(engine_->id()).empty()) << "taken";
}

TEST_F(TraceTcp, RefusedTransferKeepsItsMessageAndIsTraced) {
  ASSERT_NO_FATAL_FAILURE(Start(true));
  ASSERT_EQ(peer_->Command("dereg"), "OK");
  LocalIov l{local_->data(), 4096};
  RemoteIov r{&peer_->rw, 0, 4096};
  Status w = engine_->write(peer_id_, {&l, 1}, {&r, 1}, std::nullopt, 30s);
  EXPECT_EQ(w.code(), StatusCode::kNotFound) << w.to_string();
  EXPECT_TRUE(NamesRegion(w, peer_->region)) << "the message follows the trailer intact";
  Status rd = engine_->read(peer_id_, {&l, 1}, {&r, 1}, 30s);
  EXPECT_EQ(rd.code(), StatusCode::kNotFound) << rd.to_string();
  EXPECT_TRUE(NamesRegion(rd, peer_->region));
  const auto records = take_engine_traces(engine_->id());
  ASSERT_EQ(records.size(), 2u);
  for (const TraceRecord& rec : records) {
    SCOPED_TRACE(describe(rec));
    EXPECT_EQ(rec.status, StatusCode::kNotFound);
    EXPECT_TRUE(rec.has(TraceStage::kFrameReceived));
    EXPECT_TRUE(rec.has(TraceStage::kResponseSent));
    EXPECT_TRUE(rec.has(TraceStage::kResponseReceived));
    EXPECT_TRUE(trace_order_violations(rec).empty());
  }
}

TEST_F(TraceTcp, OffLogsNothing) {
  ASSERT_NO_FATAL_FAILURE(Start(false));
  ASSERT_NO_FATAL_FAILURE(Write(0, 65536, 4, 7));
  ASSERT_NO_FATAL_FAILURE(Read(0, 65536, 4, 7));
  EXPECT_TRUE(engine_traces(engine_->id()).empty());
}

// --- the target's side, with raw frames -------------------------------------

using namespace ferry::tcp;

class RawStream {
 public:
  explicit RawStream(const std::string& host_port) {
    const auto colon = host_port.rfind(':');
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(std::stoi(host_port.substr(colon + 1))));
    inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &sa.sin_addr);
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawStream() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  bool Send(const void* p, size_t n) {
    return ::send(fd_, p, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n);
  }
  bool Recv(void* p, size_t n) {
    auto* b = static_cast<uint8_t*>(p);
    while (n > 0) {
      pollfd pfd{fd_, POLLIN, 0};
      if (::poll(&pfd, 1, 10000) <= 0) return false;
      const ssize_t r = ::recv(fd_, b, n, 0);
      if (r <= 0) return false;
      b += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }

 private:
  int fd_ = -1;
};

struct RawResponse {
  FrameHeader header{};
  Bytes aux, payload;
};

class TraceWire : public ::testing::Test {
 protected:
  void SetUp() override {
    peer_ = StartPeer({.size = kSize, .seed = kSeed});
    ASSERT_TRUE(peer_);
    conn_ = std::make_unique<RawStream>(peer_->listen);
    ASSERT_TRUE(conn_->ok());
    Hello h{};
    h.magic = kHelloMagic;
    h.protocol_version = kProtocolVersion;
    h.engine_id = 0x7eace5ull;
    h.group_nonce = std::random_device{}();
    h.stream_count = 1;
    ASSERT_TRUE(conn_->Send(&h, sizeof h));
    HelloReply reply{};
    ASSERT_TRUE(conn_->Recv(&reply, sizeof reply));
    ASSERT_EQ(reply.status, 0);
  }

  // Sends a WRITE (payload non-empty) or READ_REQUEST of [off, off+len).
  void Request(bool write, uint64_t off, uint64_t len, uint8_t flags, TransferId id,
               const RemoteDescriptor& d) {
    WireSegment w{};
    w.region_id = d.region_id;
    w.adv_offset = d.region_offset;
    w.adv_length = d.length;
    w.key = d.key;
    w.offset = off;
    w.length = len;
    w.access = d.access;
    FrameHeader h{};
    h.magic = kFrameMagic;
    h.op = static_cast<uint8_t>(write ? Op::kWrite : Op::kReadRequest);
    h.flags = flags;
    h.count = 1;
    h.transfer_id = id;
    h.payload_bytes = write ? len : 0;
    h.aux_bytes = sizeof w;
    Bytes frame(sizeof h + sizeof w);
    std::memcpy(frame.data(), &h, sizeof h);
    std::memcpy(frame.data() + sizeof h, &w, sizeof w);
    if (write) {
      Bytes data(len);
      FillPattern(kSeed, off, data.data(), len);  // the bytes already there
      frame.insert(frame.end(), data.begin(), data.end());
    }
    ASSERT_TRUE(conn_->Send(frame.data(), frame.size()));
  }
  RawResponse Response() {
    RawResponse r;
    EXPECT_TRUE(conn_->Recv(&r.header, sizeof r.header));
    r.aux.resize(r.header.aux_bytes);
    r.payload.resize(r.header.payload_bytes);
    EXPECT_TRUE(conn_->Recv(r.aux.data(), r.aux.size()));
    EXPECT_TRUE(conn_->Recv(r.payload.data(), r.payload.size()));
    return r;
  }
  // The trailer's stamps; each set one within [before, after] and in order.
  std::vector<int64_t> Stamps(const RawResponse& r, int64_t before, int64_t after) {
    EXPECT_EQ(r.header.flags, kFlagTrace);
    TraceTrailerHead head{};
    EXPECT_GE(r.aux.size(), sizeof head);
    if (r.aux.size() < sizeof head) return {};
    std::memcpy(&head, r.aux.data(), sizeof head);
    EXPECT_EQ(head.stages, kTraceTrailerStages);
    EXPECT_GE(r.aux.size(), sizeof head + 8 * head.stages);
    std::vector<int64_t> ns(kTraceTrailerStages);
    std::memcpy(ns.data(), r.aux.data() + sizeof head, 8 * ns.size());
    int64_t prev = before;
    for (size_t i = 0; i < ns.size(); ++i) {
      if (ns[i] == 0) continue;
      EXPECT_GE(ns[i], prev) << "trailer stage " << i;
      EXPECT_LE(ns[i], after) << "trailer stage " << i;
      prev = ns[i];
    }
    return ns;
  }

  std::unique_ptr<TestPeer> peer_;
  std::unique_ptr<RawStream> conn_;
};

TEST_F(TraceWire, UntracedResponsesAreVersionOnesBytes) {
  ASSERT_NO_FATAL_FAILURE(Request(true, 4096, 1000, 0, 21, peer_->rw));
  RawResponse ack = Response();
  EXPECT_EQ(ack.header.op, static_cast<uint8_t>(Op::kWriteAck));
  EXPECT_EQ(ack.header.flags, 0);
  EXPECT_EQ(ack.header.status, 0u);
  EXPECT_EQ(ack.header.aux_bytes, 0u);
  ASSERT_NO_FATAL_FAILURE(Request(false, 4096, 1000, 0, 22, peer_->rw));
  RawResponse rr = Response();
  EXPECT_EQ(rr.header.flags, 0);
  EXPECT_EQ(rr.header.aux_bytes, 0u);
  ASSERT_EQ(rr.payload.size(), 1000u);
  EXPECT_TRUE(MatchesPattern(kSeed, 4096, rr.payload.data(), 1000));
}

TEST_F(TraceWire, AskedTheTargetAnswersWithItsStamps) {
  const int64_t t0 = trace_now_ns();
  ASSERT_NO_FATAL_FAILURE(Request(true, 4096, 1000, kFlagTrace, 31, peer_->rw));
  RawResponse ack = Response();
  const int64_t t1 = trace_now_ns();
  EXPECT_EQ(ack.header.status, 0u);
  auto w = Stamps(ack, t0, t1);
  ASSERT_EQ(w.size(), kTraceTrailerStages);
  EXPECT_NE(w[0], 0) << "frame_received";
  EXPECT_NE(w[1], 0) << "payload_received";
  EXPECT_EQ(w[2], 0) << "no GPU copy for host memory";
  EXPECT_EQ(w[3], 0);
  EXPECT_NE(w[4], 0) << "response_sent";
  EXPECT_EQ(ack.aux.size(), sizeof(TraceTrailerHead) + 8 * kTraceTrailerStages);

  ASSERT_NO_FATAL_FAILURE(Request(false, 4096, 1000, kFlagTrace, 32, peer_->rw));
  RawResponse rr = Response();
  auto r = Stamps(rr, t1, trace_now_ns());
  ASSERT_EQ(r.size(), kTraceTrailerStages);
  EXPECT_NE(r[0], 0);
  EXPECT_EQ(r[1], 0) << "a read carries no payload to the target";
  EXPECT_NE(r[4], 0);
  ASSERT_EQ(rr.payload.size(), 1000u) << "payload after the trailer";
  EXPECT_TRUE(MatchesPattern(kSeed, 4096, rr.payload.data(), 1000));

  // Refused (read-only descriptor, written): trailer, then the message.
  ASSERT_NO_FATAL_FAILURE(Request(true, 0, 64, kFlagTrace, 33, peer_->ro));
  RawResponse no = Response();
  EXPECT_EQ(no.header.status, static_cast<uint32_t>(StatusCode::kPermissionDenied));
  (void)Stamps(no, t0, trace_now_ns());
  const size_t trailer = sizeof(TraceTrailerHead) + 8 * kTraceTrailerStages;
  ASSERT_GT(no.aux.size(), trailer);
  const std::string message(no.aux.begin() + trailer, no.aux.end());
  EXPECT_NE(message.find("region"), std::string::npos) << message;
  EXPECT_EQ(peer_->Checksum(0, kSize), PatternHash(kSeed, 0, kSize)) << "nothing written";
}

}  // namespace
}  // namespace ferry::itest
