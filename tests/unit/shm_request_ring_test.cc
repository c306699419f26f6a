// The shm request ring (shm.request_ring, src/transport/shm/shm_request_ring.h)
// below the engine: its decoder against malformed slots, and a target facing
// a hand-written peer that speaks the handshake with a ring of its own and
// then writes good and bad entries into it. A bad entry closes that one
// connection with an error naming the slot; the target keeps serving others,
// and a good entry beside them moves exactly its bytes.
#include "transport/shm/shm_request_ring.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "core/random_bytes.h"
#include "core/region_registry.h"
#include "gtest/gtest.h"
#include "spdlog/spdlog.h"
#include "transport/shm/shm_transport.h"

namespace ferry::shm {
namespace {

using namespace std::chrono_literals;

// --------------------------------------------------------------- decoder ---

WireSegment segment(uint64_t region, uint64_t offset, uint64_t length, uint64_t address) {
  WireSegment w;
  w.remote = {region, 0, 1 << 20, 0x1234, kAccessReadWrite, offset, length};
  w.address = address;
  return w;
}

TEST(RequestRingDecoder, TakesWhatTheSocketCarries) {
  const WireSegment s[2] = {segment(3, 0, 4096, 64), segment(3, 8192, 100, 4160)};
  const Bytes frame = encode_request(Op::kWriteReq, 42, s, true, Bytes{1, 2, 3}, true);
  auto r = decode_ring_request(frame, 5);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->id, 42u);
  EXPECT_EQ(r->segments.size(), 2u);
  EXPECT_TRUE(r->staged);
  EXPECT_TRUE(r->has_notification);
  EXPECT_EQ(r->notification, (Bytes{1, 2, 3}));
}

TEST(RequestRingDecoder, MalformedSlotsAreRefusedNamingTheSlot) {
  const WireSegment s[1] = {segment(3, 0, 4096, 64)};
  const Bytes good = encode_request(Op::kReadReq, 7, s, false, {});
  std::vector<std::pair<std::string, Bytes>> bad;
  bad.emplace_back("short", Bytes(good.begin(), good.begin() + 10));
  bad.emplace_back("truncated body", Bytes(good.begin(), good.end() - 1));
  Bytes longer = good;
  longer.push_back(0);
  bad.emplace_back("trailing byte", longer);
  bad.emplace_back("a response", encode_response(7, Status::Ok()));
  bad.emplace_back("a cancel", encode_cancel(std::vector<uint64_t>{7}));
  Bytes magic = good;
  magic[0] ^= 0xFF;
  bad.emplace_back("bad magic", magic);
  Bytes count = good;
  count[kFrameHeaderBytes + 8] = 9;  // nine segments announced, one there
  bad.emplace_back("segment count", count);
  for (const auto& [what, frame] : bad) {
    auto r = decode_ring_request(frame, 77);
    ASSERT_FALSE(r.ok()) << what << " was accepted";
    EXPECT_EQ(r.status().code(), StatusCode::kProtocolError) << what;
    EXPECT_NE(r.status().message().find("request ring slot 77"), std::string::npos)
        << what << ": " << r.status().message();
  }
  // Random bytes never crash it.
  std::mt19937_64 rng(11);
  for (int i = 0; i < 2000; ++i) {
    Bytes noise(rng() % 200);
    for (auto& b : noise) b = static_cast<uint8_t>(rng());
    if (i % 2 == 0 && noise.size() >= kFrameHeaderBytes) {
      std::memcpy(noise.data(), good.data(), kFrameHeaderBytes);  // a plausible header
    }
    (void)decode_ring_request(noise, 1);
    (void)decode_ring_answer(noise, 1);
  }
}

// ------------------------------------------------------ a target process ---

class Events : public TransportEvents {
 public:
  void on_notification(PeerId, Bytes payload) override {
    std::lock_guard lock(mu);
    notes.push_back(std::move(payload));
    cv.notify_all();
  }
  void on_peer_up(PeerId peer) override {
    std::lock_guard lock(mu);
    up.insert(peer);
    cv.notify_all();
  }
  void on_peer_down(PeerId peer, const Status& reason) override {
    std::lock_guard lock(mu);
    down[peer] = reason;
    cv.notify_all();
  }
  bool wait_for(const std::function<bool()>& pred) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, 5s, pred);
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Bytes> notes;
  std::set<PeerId> up;
  std::map<PeerId, Status> down;
};

struct Side {
  explicit Side(std::map<std::string, std::string> given) {
    given.emplace("shm.request_ring", "true");
    auto o = OptionSet::resolve(std::span<const OptionSpec>(kShmOptionSpecs, kShmOptionSpecCount),
                                given);
    EXPECT_TRUE(o.ok()) << o.status().to_string();
    options = std::move(o.value());
    EXPECT_TRUE(ferry::random_bytes(&id, sizeof id).ok());
    TransportContext ctx;
    ctx.engine_id = id;
    ctx.registry = &registry;
    ctx.events = &events;
    ctx.options = &options;
    spdlog::default_logger_raw();  // before the transport's threads (see shm_transport_test)
    started = transport.start(ctx);
  }
  uint64_t counter(const std::string& name) const {
    for (const auto& [n, v] : transport.counters()) {
      if (n == name) return v;
    }
    return ~uint64_t{0};
  }
  RegionRegistry registry;
  Events events;
  OptionSet options;
  ShmTransport transport;
  uint64_t id = 0;
  Status started;
};

Segment local_segment(uint8_t* local, uint64_t length, const RemoteDescriptor& d, uint64_t offset) {
  Segment s;
  s.local = local;
  s.length = length;
  s.remote = {d.region_id, d.region_offset, d.length, d.key, d.access, offset, length};
  return s;
}

class RequestRingTransportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (Status s = check_self(); !s.ok() && GetParam() != "staging") GTEST_SKIP() << s.message();
  }
};

INSTANTIATE_TEST_SUITE_P(Modes, RequestRingTransportTest, ::testing::Values("auto", "staging"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// Small writes, reads and notifications go through the ring (the target
// counts them) and move every byte; a large one still goes on the socket.
TEST_P(RequestRingTransportTest, SmallRequestsGoThroughTheRing) {
  Side a(std::map<std::string, std::string>{{"shm.mode", GetParam()}});
  Side b(std::map<std::string, std::string>{{"shm.mode", GetParam()}});
  ASSERT_TRUE(a.started.ok() && b.started.ok());
  auto peer = a.transport.connect(b.transport.local_address(), b.id);
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  ASSERT_TRUE(b.events.wait_for([&] { return b.events.up.count(a.id) == 1; }));
  std::vector<uint8_t> target(1 << 20, 0);
  auto region = b.registry.add(target.data(), target.size());
  ASSERT_TRUE(region.ok());
  auto d = b.registry.advertise(b.id, region->id, 0, target.size(), kAccessReadWrite);
  ASSERT_TRUE(d.ok());
  std::mt19937_64 rng(3);
  std::vector<uint8_t> src(1 << 20), back(1 << 20);
  for (auto& x : src) x = static_cast<uint8_t>(rng());
  uint64_t id = 1;
  for (uint64_t size : {uint64_t{1}, uint64_t{4096}, uint64_t{65536}, uint64_t{300 << 10}}) {
    const uint64_t at = rng() % (target.size() - size);
    auto w = std::make_shared<Transfer>(id++, TransferOp::kWrite, b.id);
    w->transport = &a.transport;
    ASSERT_TRUE(a.transport.post_write(b.id, w, {local_segment(src.data(), size, *d, at)}).ok());
    ASSERT_TRUE(w->wait_until(std::chrono::steady_clock::now() + 10s, 200us));
    ASSERT_TRUE(w->status().ok()) << w->status().to_string();
    ASSERT_EQ(0, std::memcmp(target.data() + at, src.data(), size)) << size;
    auto r = std::make_shared<Transfer>(id++, TransferOp::kRead, b.id);
    r->transport = &a.transport;
    ASSERT_TRUE(a.transport.post_read(b.id, r, {local_segment(back.data(), size, *d, at)}).ok());
    ASSERT_TRUE(r->wait_until(std::chrono::steady_clock::now() + 10s, 200us));
    ASSERT_TRUE(r->status().ok()) << r->status().to_string();
    ASSERT_EQ(0, std::memcmp(back.data(), src.data(), size)) << size;
  }
  auto n = std::make_shared<Transfer>(id++, TransferOp::kNotify, b.id);
  n->transport = &a.transport;
  ASSERT_TRUE(a.transport.post_notification(b.id, n, Bytes{9, 8, 7}).ok());
  ASSERT_TRUE(n->wait_until(std::chrono::steady_clock::now() + 10s));
  ASSERT_TRUE(b.events.wait_for([&] { return b.events.notes.size() == 1; }));
  // Three sizes of each direction and the notification: 7 by the ring.
  EXPECT_EQ(b.counter("ring_requests"), 7u);
}

// A peer that speaks the handshake itself, in staging mode, with a request
// ring it writes into as it likes.
class RawRingPeer {
 public:
  explicit RawRingPeer(const Side& target) : target_(target) {
    auto address = decode_address(target.transport.local_address());
    EXPECT_TRUE(address.ok());
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, address->socket_path.data(), address->socket_path.size());
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
    timeval tv{5, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    EXPECT_TRUE(ferry::random_bytes(&id_, sizeof id_).ok());
    auto area = StagingArea::create(kMinStagingBytes, "raw-ring-peer-area");
    EXPECT_TRUE(area.ok());
    area_ = std::move(area.value());
    auto ring = RequestRing::create("raw-ring-peer");
    EXPECT_TRUE(ring.ok());
    ring_ = std::move(ring.value());
  }
  ~RawRingPeer() {
    if (fd_ >= 0) ::close(fd_);
  }

  // The whole handshake: HELLO, HELLO_ACK (it offers rings), HELLO_DONE with
  // our area and ring, the target's RING.
  void handshake() {
    Hello h;
    h.engine_id = id_;
    h.expected_engine_id = target_.id;
    h.probe_address = reinterpret_cast<uint64_t>(&probe_);
    h.probe_value = probe_;
    h.mode = Mode::kStaging;
    send(encode_hello(h));
    auto ack = decode_hello_ack(receive(Op::kHelloAck));
    ASSERT_TRUE(ack.ok()) << ack.status().to_string();
    ASSERT_NE(ack->features & kFeatureRequestRing, 0u) << "the target offers no request ring";
    HelloDone d;
    d.mode = Mode::kStaging;
    d.staging_bytes = area_.size();
    d.request_ring = true;
    const Bytes frame = encode_hello_done(d);
    iovec iov{const_cast<uint8_t*>(frame.data()), frame.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(2 * sizeof(int));
    const int fds[2] = {area_.fd(), ring_.fd()};
    std::memcpy(CMSG_DATA(c), fds, sizeof fds);
    ASSERT_EQ(::sendmsg(fd_, &m, MSG_NOSIGNAL), static_cast<ssize_t>(frame.size()));
    auto bytes = decode_ring(receive(Op::kRing));
    ASSERT_TRUE(bytes.ok());
    EXPECT_EQ(*bytes, kRingBytes);
  }

  // Posts `frame` in the slot of `sequence` (as sequence `claimed`) and
  // rings the target.
  void post(uint64_t sequence, ByteView frame, uint64_t claimed, uint32_t length = 0) {
    ring_.post_claiming(ring_slot(sequence), claimed, frame,
                        length != 0 ? length : static_cast<uint32_t>(frame.size()));
    send(encode_ring_wake());
  }
  // The answer in the slot of `sequence`, waited for.
  Result<Response> answer(uint64_t sequence) {
    const uint32_t slot = ring_slot(sequence);
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (ring_.state(slot).load() != static_cast<uint32_t>(SlotState::kAnswered)) {
      if (std::chrono::steady_clock::now() > deadline) return err::Timeout("no answer");
      std::this_thread::sleep_for(100us);
    }
    return ring_.take_answer(slot);
  }
  // True when the target closed the connection (frames before the close,
  // wake-ups for answers, are skipped).
  bool closed() {
    uint8_t bytes[256];
    for (;;) {
      const ssize_t n = ::recv(fd_, bytes, sizeof bytes, 0);
      if (n == 0) return true;
      if (n < 0) return false;  // timed out: still open
    }
  }
  uint8_t* area() const { return area_.data(); }
  uint64_t id() const { return id_; }

 private:
  void send(const Bytes& frame) {
    EXPECT_EQ(::send(fd_, frame.data(), frame.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(frame.size()));
  }
  // One frame of `op` (descriptors that ride along are closed).
  Bytes receive(Op op) {
    Bytes head(kFrameHeaderBytes);
    read_all(head.data(), head.size());
    auto h = decode_header(head);
    EXPECT_TRUE(h.ok());
    EXPECT_EQ(h->op, op) << op_name(h->op);
    Bytes body(h->body_bytes);
    read_all(body.data(), body.size());
    return body;
  }
  void read_all(uint8_t* out, size_t n) {
    size_t done = 0;
    while (done < n) {
      iovec iov{out + done, n - done};
      alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
      msghdr m{};
      m.msg_iov = &iov;
      m.msg_iovlen = 1;
      m.msg_control = control;
      m.msg_controllen = sizeof control;
      const ssize_t r = ::recvmsg(fd_, &m, MSG_CMSG_CLOEXEC);
      ASSERT_GT(r, 0) << "the target closed the connection or timed out";
      for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_type != SCM_RIGHTS) continue;
        for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
          ::close(fd);
        }
      }
      done += static_cast<size_t>(r);
    }
  }

  const Side& target_;
  int fd_ = -1;
  uint64_t id_ = 0;
  uint64_t probe_ = 0x5eed;
  StagingArea area_;
  RequestRing ring_;
};

TEST(RequestRingHostile, BadEntriesCloseTheirConnectionNamingTheSlot) {
  Side b(std::map<std::string, std::string>{{"shm.mode", "staging"}});
  ASSERT_TRUE(b.started.ok()) << b.started.to_string();
  std::vector<uint8_t> dst(8192, 0x11);
  auto region = b.registry.add(dst.data(), dst.size());
  ASSERT_TRUE(region.ok());
  auto d = b.registry.advertise(b.id, region->id, 0, dst.size(), kAccessReadWrite);
  ASSERT_TRUE(d.ok());
  auto write_of = [&](uint64_t id, uint64_t area_offset, uint64_t offset, uint64_t length) {
    WireSegment w;
    w.remote = {d->region_id, d->region_offset, d->length, d->key, d->access, offset, length};
    w.address = area_offset;
    return encode_request(Op::kWriteReq, id, std::span(&w, 1), false, {}, /*staged=*/true);
  };

  // A good entry: its bytes land, nothing else changes. An entry naming a
  // range outside the peer's area is refused in its answer (as on the
  // socket) and the connection stays.
  {
    RawRingPeer raw(b);
    ASSERT_NO_FATAL_FAILURE(raw.handshake());
    ASSERT_TRUE(b.events.wait_for([&] { return b.events.up.count(raw.id()) == 1; }));
    std::memset(raw.area(), 0xAB, 4096);
    raw.post(0, write_of(5, 0, 100, 64), 0);
    auto a = raw.answer(0);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ(a->id, 5u);
    EXPECT_TRUE(a->status.ok()) << a->status.to_string();
    for (size_t i = 0; i < dst.size(); ++i) {
      ASSERT_EQ(dst[i], i >= 100 && i < 164 ? 0xAB : 0x11) << i;
    }
    raw.post(1, write_of(6, kMinStagingBytes - 10, 0, 64), 1);
    a = raw.answer(1);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ(a->status.code(), StatusCode::kProtocolError) << a->status.to_string();
    EXPECT_NE(a->status.message().find("outside the peer's"), std::string::npos)
        << a->status.message();
    EXPECT_EQ(dst[0], 0x11);
    EXPECT_FALSE(raw.closed());
  }

  // Entries that are not requests of the expected sequence.
  struct Bad {
    const char* what;
    uint64_t sequence;  // the slot
    uint64_t claimed;   // what the slot says
    Bytes frame;
    uint32_t length;    // the slot's length word (0: the frame's)
    const char* named;  // in the reason the connection went down
  };
  Bytes noise(300);
  for (size_t i = 0; i < noise.size(); ++i) noise[i] = static_cast<uint8_t>(i * 7 + 3);
  const std::vector<Bad> bad = {
      {"a skipped sequence", 0, 1, write_of(5, 0, 0, 64), 0,
       "holds request sequence 1, expected 0"},
      {"noise", 0, 0, noise, 0, "request ring slot 0"},
      {"a response", 0, 0, encode_response(5, Status::Ok()), 0, "not a request"},
      {"a length past the slot", 0, 0, write_of(5, 0, 0, 64),
       static_cast<uint32_t>(kRingRequestBytes + 1), "announces a request of 8193 bytes"},
      {"a length short of the frame", 0, 0, write_of(5, 0, 0, 64), 40, "request ring slot 0"},
  };
  for (const Bad& x : bad) {
    SCOPED_TRACE(x.what);
    RawRingPeer raw(b);
    ASSERT_NO_FATAL_FAILURE(raw.handshake());
    ASSERT_TRUE(b.events.wait_for([&] { return b.events.up.count(raw.id()) == 1; }));
    raw.post(x.sequence, x.frame, x.claimed, x.length);
    EXPECT_TRUE(raw.closed()) << "the target kept the connection";
    ASSERT_TRUE(b.events.wait_for([&] { return b.events.down.count(raw.id()) == 1; }));
    std::lock_guard lock(b.events.mu);
    const std::string why = b.events.down[raw.id()].message();
    EXPECT_NE(why.find(x.named), std::string::npos) << why;
  }
  // Nothing of it reached the region, and the target still serves others.
  for (size_t i = 0; i < dst.size(); ++i) {
    ASSERT_EQ(dst[i], i >= 100 && i < 164 ? 0xAB : 0x11) << i;
  }
  RawRingPeer after(b);
  ASSERT_NO_FATAL_FAILURE(after.handshake());
  std::memset(after.area(), 0xCD, 64);
  after.post(0, write_of(9, 0, 1000, 64), 0);
  auto a = after.answer(0);
  ASSERT_TRUE(a.ok() && a->status.ok());
  EXPECT_EQ(dst[1000], 0xCD);
}

}  // namespace
}  // namespace ferry::shm
