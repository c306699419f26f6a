// The shm transport below the engine: two transports in one process, joined
// through their Unix sockets (cross-memory attach on our own pid works as it
// does between processes). Writes and reads with and without notifications,
// large transfers cut into requests, target-side refusals, deregistration,
// both directions of one connection, and peer loss.
#include "transport/shm/shm_transport.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sodium.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "fmt/format.h"
#include "transport/shm/cma.h"

namespace ferry::shm {
namespace {

using namespace std::chrono_literals;

class Events : public TransportEvents {
 public:
  void on_notification(PeerId peer, Bytes payload) override {
    std::lock_guard lock(mu);
    notes.emplace_back(peer, std::move(payload));
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
  template <typename Pred>
  bool wait_for(Pred pred) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, 5s, pred);
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<PeerId, Bytes>> notes;
  std::set<PeerId> up;
  std::map<PeerId, Status> down;
};

struct Side {
  explicit Side(std::map<std::string, std::string> given = {}) {
    auto o = OptionSet::resolve(std::span<const OptionSpec>(kShmOptionSpecs, kShmOptionSpecCount),
                                given);
    EXPECT_TRUE(o.ok()) << o.status().to_string();
    options = std::move(o.value());
    randombytes_buf(&id, sizeof id);
    TransportContext ctx;
    ctx.engine_id = id;
    ctx.registry = &registry;
    ctx.events = &events;
    ctx.options = &options;
    started = transport.start(ctx);
  }
  RegionRegistry registry;
  Events events;
  OptionSet options;
  ShmTransport transport;
  uint64_t id = 0;
  Status started;
};

class ShmTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GE(sodium_init(), 0);
    if (Status s = check_self(); !s.ok()) GTEST_SKIP() << s.message();
  }
  // a connects to b; both see each other up.
  static void join(Side& a, Side& b) {
    ASSERT_TRUE(a.started.ok()) << a.started.to_string();
    ASSERT_TRUE(b.started.ok()) << b.started.to_string();
    auto peer = a.transport.connect(b.transport.local_address(), b.id);
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    ASSERT_EQ(*peer, b.id);
    ASSERT_TRUE(a.transport.is_connected(b.id));
    ASSERT_TRUE(b.events.wait_for([&] { return b.events.up.count(a.id) == 1; }));
    ASSERT_TRUE(b.transport.is_connected(a.id));
  }
};

struct Buffer {
  explicit Buffer(size_t n, uint8_t seed = 0) : bytes(n) {
    for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(i * 31 + seed);
  }
  std::vector<uint8_t> bytes;
};

// Registers `buf` on `owner` and advertises all of it.
RemoteDescriptor advertise(Side& owner, std::vector<uint8_t>& buf, uint8_t access,
                           RegionId* region = nullptr) {
  auto r = owner.registry.add(buf.data(), buf.size());
  EXPECT_TRUE(r.ok());
  if (region) *region = r->id;
  auto d = owner.registry.advertise(owner.id, r->id, 0, buf.size(), access);
  EXPECT_TRUE(d.ok());
  return *d;
}

Segment seg(uint8_t* local, uint64_t length, const RemoteDescriptor& d, uint64_t offset) {
  Segment s;
  s.local = local;
  s.length = length;
  s.remote = {d.region_id, d.region_offset, d.length, d.key, d.access, offset, length};
  return s;
}

Status run(const std::shared_ptr<Transfer>& t) {
  if (!t->wait_until(std::chrono::steady_clock::now() + 10s)) return err::Timeout("test wait");
  return t->status();
}

TEST_F(ShmTransportTest, WriteAndReadSmallAndLarge) {
  Side a, b;
  join(a, b);
  for (size_t n : {size_t{1}, size_t{4096}, size_t{9} << 20}) {  // 9 MiB: 3 requests
    Buffer src(n, 1), dst(n, 2), back(n, 3);
    RemoteDescriptor d = advertise(b, dst.bytes, kAccessReadWrite);
    auto w = std::make_shared<Transfer>(1, TransferOp::kWrite, b.id);
    ASSERT_TRUE(a.transport.post_write(b.id, w, {seg(src.bytes.data(), n, d, 0)}).ok());
    ASSERT_TRUE(run(w).ok()) << w->status().to_string();
    EXPECT_EQ(dst.bytes, src.bytes) << n;
    auto r = std::make_shared<Transfer>(2, TransferOp::kRead, b.id);
    ASSERT_TRUE(a.transport.post_read(b.id, r, {seg(back.bytes.data(), n, d, 0)}).ok());
    ASSERT_TRUE(run(r).ok()) << r->status().to_string();
    EXPECT_EQ(back.bytes, src.bytes) << n;
  }
}

TEST_F(ShmTransportTest, ManySegmentsSpanSeveralRequests) {
  Side a(std::map<std::string, std::string>{{"shm.max_request_segments", "16"}});
  Side b;
  join(a, b);
  const size_t n = 1000;
  Buffer src(n * 8, 5), dst(n * 8, 6);
  RemoteDescriptor d = advertise(b, dst.bytes, kAccessWrite);
  std::vector<Segment> segs;
  // Scattered: segment i goes to slot (n - 1 - i).
  for (size_t i = 0; i < n; ++i)
    segs.push_back(seg(src.bytes.data() + 8 * i, 8, d, 8 * (n - 1 - i)));
  auto w = std::make_shared<Transfer>(1, TransferOp::kWrite, b.id);
  w->notification = {'o', 'k'};
  w->has_notification = true;
  ASSERT_TRUE(a.transport.post_write(b.id, w, segs).ok());
  ASSERT_TRUE(run(w).ok()) << w->status().to_string();
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(0, std::memcmp(dst.bytes.data() + 8 * (n - 1 - i), src.bytes.data() + 8 * i, 8));
  }
  // The notification arrived, once, after the data (the write completed on its answer).
  std::lock_guard lock(b.events.mu);
  ASSERT_EQ(b.events.notes.size(), 1u);
  EXPECT_EQ(b.events.notes[0].first, a.id);
  EXPECT_EQ(b.events.notes[0].second, (Bytes{'o', 'k'}));
}

TEST_F(ShmTransportTest, NotificationsEmbeddedAndStandalone) {
  Side a, b;
  join(a, b);
  Buffer src(100, 1), dst(100, 2);
  RemoteDescriptor d = advertise(b, dst.bytes, kAccessWrite);
  auto w = std::make_shared<Transfer>(1, TransferOp::kWrite, b.id);
  w->has_notification = true;  // empty payload: still delivered
  ASSERT_TRUE(a.transport.post_write(b.id, w, {seg(src.bytes.data(), 100, d, 0)}).ok());
  ASSERT_TRUE(run(w).ok());
  auto n = std::make_shared<Transfer>(2, TransferOp::kNotify, b.id);
  ASSERT_TRUE(a.transport.post_notification(b.id, n, Bytes{'h', 'i'}).ok());
  ASSERT_TRUE(run(n).ok());
  std::lock_guard lock(b.events.mu);
  ASSERT_EQ(b.events.notes.size(), 2u);
  EXPECT_TRUE(b.events.notes[0].second.empty());
  EXPECT_EQ(b.events.notes[1].second, (Bytes{'h', 'i'}));
  auto big = std::make_shared<Transfer>(3, TransferOp::kNotify, b.id);
  EXPECT_EQ(a.transport.post_notification(b.id, big, Bytes(kMaxNotificationBytes + 1)).code(),
            StatusCode::kInvalidArgument);
}

TEST_F(ShmTransportTest, TargetRefusesAndNothingIsCopied) {
  Side a, b;
  join(a, b);
  Buffer src(256, 1), dst(256, 2);
  const std::vector<uint8_t> before = dst.bytes;
  RemoteDescriptor d = advertise(b, dst.bytes, kAccessRead);  // read-only
  // Wrong access: the first segment is fine for a read but this is a write.
  auto w = std::make_shared<Transfer>(1, TransferOp::kWrite, b.id);
  ASSERT_TRUE(a.transport.post_write(b.id, w, {seg(src.bytes.data(), 256, d, 0)}).ok());
  Status s = run(w);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  EXPECT_NE(s.message().find("region"), std::string::npos) << s.message();
  // A forged key on the second segment: the first one is not copied either.
  RemoteDescriptor rw = advertise(b, dst.bytes, kAccessReadWrite);
  RemoteDescriptor forged = rw;
  forged.key ^= 1;
  auto w2 = std::make_shared<Transfer>(2, TransferOp::kWrite, b.id);
  w2->has_notification = true;
  ASSERT_TRUE(a.transport
                  .post_write(b.id, w2,
                              {seg(src.bytes.data(), 128, rw, 0),
                               seg(src.bytes.data() + 128, 128, forged, 128)})
                  .ok());
  s = run(w2);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  EXPECT_NE(s.message().find("segment 1"), std::string::npos) << s.message();
  EXPECT_EQ(dst.bytes, before);
  // Out of range.
  auto w3 = std::make_shared<Transfer>(3, TransferOp::kWrite, b.id);
  Segment far = seg(src.bytes.data(), 16, rw, 250);
  ASSERT_TRUE(a.transport.post_write(b.id, w3, {far}).ok());
  EXPECT_EQ(run(w3).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(dst.bytes, before);
  std::lock_guard lock(b.events.mu);
  EXPECT_TRUE(b.events.notes.empty());  // failed writes deliver no notification
}

TEST_F(ShmTransportTest, DeregisteredRegionIsNotFound) {
  Side a, b;
  join(a, b);
  Buffer src(64, 1), dst(64, 2);
  RegionId region = 0;
  RemoteDescriptor d = advertise(b, dst.bytes, kAccessReadWrite, &region);
  ASSERT_TRUE(b.registry.remove(region).ok());
  auto w = std::make_shared<Transfer>(1, TransferOp::kWrite, b.id);
  ASSERT_TRUE(a.transport.post_write(b.id, w, {seg(src.bytes.data(), 64, d, 0)}).ok());
  Status s = run(w);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
  EXPECT_NE(s.message().find(std::to_string(region)), std::string::npos) << s.message();
}

TEST_F(ShmTransportTest, BothDirectionsOnOneConnection) {
  Side a, b;
  join(a, b);
  Buffer src(1000, 1), dst(1000, 2);
  RemoteDescriptor d = advertise(a, dst.bytes, kAccessWrite);
  // b never called connect(): it uses the connection a opened.
  auto w = std::make_shared<Transfer>(1, TransferOp::kWrite, a.id);
  ASSERT_TRUE(b.transport.post_write(a.id, w, {seg(src.bytes.data(), 1000, d, 0)}).ok());
  ASSERT_TRUE(run(w).ok()) << w->status().to_string();
  EXPECT_EQ(dst.bytes, src.bytes);
  EXPECT_NE(b.transport.peer_address(a.id).find("pid "), std::string::npos);
}

TEST_F(ShmTransportTest, RefusalsAtConnect) {
  Side a, b;
  ASSERT_TRUE(a.started.ok());
  ASSERT_TRUE(b.started.ok());
  auto wrong = a.transport.connect(b.transport.local_address(), 0x1234);
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("0000000000001234"), std::string::npos)
      << wrong.status().message();
  EXPECT_FALSE(a.transport.is_connected(b.id));
  // Nobody listens at this path.
  auto none = a.transport.connect(encode_address({"/tmp/ferry-no-such-engine.sock", 1}), 0);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kPeerDisconnected) << none.status().to_string();
  // Not a peer: posts say so with the id.
  Buffer src(8);
  auto t = std::make_shared<Transfer>(1, TransferOp::kWrite, 77);
  Status s = a.transport.post_write(77, t, {seg(src.bytes.data(), 8, RemoteDescriptor{}, 0)});
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("000000000000004d"), std::string::npos) << s.message();
  // GPU segments are refused.
  join(a, b);
  Segment gpu = seg(src.bytes.data(), 8, RemoteDescriptor{}, 0);
  gpu.remote_device = 0;
  EXPECT_EQ(a.transport.post_write(b.id, t, {gpu}).code(), StatusCode::kNotSupported);
}

TEST_F(ShmTransportTest, PeerShutdownFailsInFlightAndReportsDown) {
  Side a;
  auto b = std::make_unique<Side>();
  join(a, *b);
  const PeerId bid = b->id;
  b->transport.shutdown(err::Cancelled("test shut b down"));
  ASSERT_TRUE(a.events.wait_for([&] { return a.events.down.count(bid) == 1; }));
  EXPECT_FALSE(a.transport.is_connected(bid));
  Buffer src(8);
  auto t = std::make_shared<Transfer>(1, TransferOp::kWrite, bid);
  Status s = a.transport.post_write(bid, t, {seg(src.bytes.data(), 8, RemoteDescriptor{}, 0)});
  EXPECT_EQ(s.code(), StatusCode::kPeerDisconnected) << s.to_string();
  EXPECT_NE(s.message().find(fmt::format("{:016x}", bid)), std::string::npos) << s.message();
}

TEST_F(ShmTransportTest, CancelReturnsOnceAnswered) {
  Side a, b;
  join(a, b);
  Buffer src(8 << 20, 1), dst(8 << 20, 2);
  RemoteDescriptor d = advertise(b, dst.bytes, kAccessWrite);
  auto w = std::make_shared<Transfer>(1, TransferOp::kWrite, b.id);
  ASSERT_TRUE(a.transport.post_write(b.id, w, {seg(src.bytes.data(), 8 << 20, d, 0)}).ok());
  a.transport.cancel(*w);
  // After cancel no request of it is in flight; the connection still works.
  EXPECT_TRUE(a.transport.is_connected(b.id));
  auto w2 = std::make_shared<Transfer>(2, TransferOp::kWrite, b.id);
  ASSERT_TRUE(a.transport.post_write(b.id, w2, {seg(src.bytes.data(), 64, d, 0)}).ok());
  EXPECT_TRUE(run(w2).ok());
}

// Two real processes: the child owns a region, the parent writes into it and
// reads it back through the child's socket, then the child is killed and the
// parent's transfer fails at once with the peer down.
TEST_F(ShmTransportTest, CrossProcessWriteReadAndKill) {
  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  const size_t n = 3 << 20;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child: serve until told to check, then report the check.
    Side b;
    Buffer dst(n, 9);
    if (!b.started.ok()) _exit(2);
    RemoteDescriptor d = advertise(b, dst.bytes, kAccessReadWrite);
    const Bytes address = b.transport.local_address();
    const Bytes desc = d.to_bytes();
    const uint32_t len = static_cast<uint32_t>(address.size());
    if (write(to_parent[1], &len, 4) != 4 || write(to_parent[1], address.data(), len) != len ||
        write(to_parent[1], desc.data(), desc.size()) != static_cast<ssize_t>(desc.size())) {
      _exit(3);
    }
    char go = 0;
    if (read(to_child[0], &go, 1) != 1) _exit(4);
    Buffer expected(n, 1);
    const bool same = dst.bytes == expected.bytes;
    if (write(to_parent[1], &same, 1) != 1) _exit(5);
    pause();  // killed by the parent
    _exit(0);
  }
  uint32_t len = 0;
  ASSERT_EQ(read(to_parent[0], &len, 4), 4);
  Bytes address(len);
  ASSERT_EQ(read(to_parent[0], address.data(), len), static_cast<ssize_t>(len));
  Bytes desc(RemoteDescriptor::kEncodedSize);
  ASSERT_EQ(read(to_parent[0], desc.data(), desc.size()), static_cast<ssize_t>(desc.size()));
  auto d = RemoteDescriptor::from_bytes(desc);
  ASSERT_TRUE(d.ok());
  Side a;
  ASSERT_TRUE(a.started.ok());
  auto peer = a.transport.connect(address, d->engine_id);
  if (!peer.ok()) {
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    // A host whose ptrace policy refuses siblings says so; that is the point.
    GTEST_SKIP() << peer.status().to_string();
  }
  EXPECT_NE(a.transport.peer_address(d->engine_id).find(fmt::format("pid {}", child)),
            std::string::npos);
  Buffer src(n, 1), back(n, 0);
  auto w = std::make_shared<Transfer>(1, TransferOp::kWrite, d->engine_id);
  ASSERT_TRUE(a.transport.post_write(d->engine_id, w, {seg(src.bytes.data(), n, *d, 0)}).ok());
  ASSERT_TRUE(run(w).ok()) << w->status().to_string();
  auto r = std::make_shared<Transfer>(2, TransferOp::kRead, d->engine_id);
  ASSERT_TRUE(a.transport.post_read(d->engine_id, r, {seg(back.bytes.data(), n, *d, 0)}).ok());
  ASSERT_TRUE(run(r).ok()) << r->status().to_string();
  EXPECT_EQ(back.bytes, src.bytes);
  char go = 1;
  ASSERT_EQ(write(to_child[1], &go, 1), 1);
  bool same = false;
  ASSERT_EQ(read(to_parent[0], &same, 1), 1);
  EXPECT_TRUE(same);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  ASSERT_TRUE(a.events.wait_for([&] { return a.events.down.count(d->engine_id) == 1; }));
  auto late = std::make_shared<Transfer>(3, TransferOp::kWrite, d->engine_id);
  EXPECT_EQ(a.transport.post_write(d->engine_id, late, {seg(src.bytes.data(), 8, *d, 0)}).code(),
            StatusCode::kPeerDisconnected);
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) close(fd);
}

}  // namespace
}  // namespace ferry::shm
