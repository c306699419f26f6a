// The tcp handshake's metadata exchange (revision 2, src/transport/tcp/tcp_wire.h)
// spoken with a plain socket: against a ferry_test_peer, the metadata a
// connecting side sends is checked exactly as connect(metadata) checks it --
// garbage, another protocol version, another engine's metadata and an
// impossible size are refused with a reply naming what is wrong, and the
// target keeps serving a real engine; and against a fake accepting side, the
// engine refuses what it is sent in return. A connecting side of revision 0
// (engines before revisions existed) gets revision 1 and no metadata.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <random>
#include <thread>

#include "core/metadata.h"
#include "fixture.h"
#include "transport/tcp/tcp_wire.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;
using namespace ferry::tcp;

// A blocking socket with a 10 s receive timeout.
class Socket {
 public:
  explicit Socket(const std::string& host_port) {
    const auto colon = host_port.rfind(':');
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(std::stoi(host_port.substr(colon + 1))));
    inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &sa.sin_addr);
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    timeval tv{10, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  explicit Socket(int fd) : fd_(fd) {
    timeval tv{10, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  bool Send(const void* p, size_t n) {
    return n == 0 || ::send(fd_, p, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n);
  }
  bool Recv(void* p, size_t n) {
    auto* b = static_cast<uint8_t*>(p);
    while (n > 0) {
      const ssize_t r = ::recv(fd_, b, n, 0);
      if (r <= 0) return false;
      b += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  // True once the other side closed (EOF or reset) within the timeout.
  bool Closed() {
    char c;
    return ::recv(fd_, &c, 1, 0) <= 0;
  }

 private:
  int fd_ = -1;
};

Hello MakeHello(uint64_t engine_id, uint16_t revision, uint32_t metadata_bytes) {
  Hello h{};
  h.magic = kHelloMagic;
  h.protocol_version = kProtocolVersion;
  h.engine_id = engine_id;
  h.group_nonce = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  h.stream_count = 1;
  h.handshake_revision = revision;
  h.metadata_bytes = metadata_bytes;
  return h;
}

// Metadata as an engine `id` on this host would send it.
Bytes MetadataOf(uint64_t id, uint16_t protocol = kProtocolVersion) {
  EngineMetadata m;
  m.engine_id = id;
  m.protocol_version = protocol;
  m.hostname = "raw";
  m.host_id = "raw-host";
  m.transports.push_back({"tcp", Bytes{'1', '2', '7', '.', '0', '.', '0', '.', '1', ':', '9'}});
  return m.encode();
}

class HandshakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    peer_ = StartPeer({.size = 1 << 16, .seed = 5});
    ASSERT_TRUE(peer_);
  }
  void TearDown() override {
    if (!peer_ || HasFatalFailure()) return;
    // The target still serves a real engine, by address, every byte checked.
    auto e = MakeEngine();
    ASSERT_TRUE(e);
    auto p = e->connect(std::string_view(peer_->listen));
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    LocalBuffer buf(*e, 65536);
    LocalIov l{buf.data(), 65536};
    RemoteIov r{&peer_->rw, 0, 65536};
    ASSERT_TRUE(e->read(*p, {&l, 1}, {&r, 1}).ok());
    EXPECT_TRUE(MatchesPattern(5, 0, buf.data(), 65536));
  }

  // Sends a revision-2 Hello declaring `ours.size()` bytes, checks the
  // target's reply and metadata, sends `ours`; returns the verdict and its
  // message.
  HelloReply Exchange(uint64_t id, const Bytes& ours, std::string* message) {
    Socket s(peer_->listen);
    EXPECT_TRUE(s.ok());
    Hello h = MakeHello(id, kHandshakeRevisionMetadata, static_cast<uint32_t>(ours.size()));
    EXPECT_TRUE(s.Send(&h, sizeof h));
    HelloReply reply{};
    EXPECT_TRUE(s.Recv(&reply, sizeof reply));
    EXPECT_EQ(reply.status, 0);
    EXPECT_EQ(reply.handshake_revision, kHandshakeRevisionMetadata);
    EXPECT_GT(reply.message_bytes, 0u);
    Bytes theirs(reply.message_bytes);
    EXPECT_TRUE(s.Recv(theirs.data(), theirs.size()));
    auto m = EngineMetadata::decode(theirs);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    if (m.ok()) {
      EXPECT_EQ(m->engine_id, peer_->engine_id);
      EXPECT_NE(m->find("tcp"), nullptr);
    }
    EXPECT_TRUE(s.Send(ours.data(), ours.size()));
    HelloReply verdict{};
    EXPECT_TRUE(s.Recv(&verdict, sizeof verdict)) << "no verdict on the metadata";
    EXPECT_EQ(verdict.magic, kHelloMagic);
    message->assign(std::min(verdict.message_bytes, kMaxHelloMessage), '\0');
    EXPECT_TRUE(s.Recv(message->data(), message->size()));
    if (verdict.status != 0) {
      EXPECT_TRUE(s.Closed()) << "a refused stream stays open";
    }
    return verdict;
  }

  std::unique_ptr<TestPeer> peer_;
};

TEST_F(HandshakeTest, ConnectorOfRevisionZeroGetsRevisionOneAndNoMetadata) {
  Socket s(peer_->listen);
  ASSERT_TRUE(s.ok());
  Hello h = MakeHello(0x5151, 0, 0);
  ASSERT_TRUE(s.Send(&h, sizeof h));
  HelloReply reply{};
  ASSERT_TRUE(s.Recv(&reply, sizeof reply));
  EXPECT_EQ(reply.status, 0);
  EXPECT_EQ(reply.engine_id, peer_->engine_id);
  EXPECT_EQ(reply.handshake_revision, kHandshakeRevisionPlain);
  EXPECT_EQ(reply.message_bytes, 0u);
}

TEST_F(HandshakeTest, RevisionTwoWithoutMetadataIsRevisionOne) {
  Socket s(peer_->listen);
  ASSERT_TRUE(s.ok());
  Hello h = MakeHello(0x5152, kHandshakeRevisionMetadata, 0);
  ASSERT_TRUE(s.Send(&h, sizeof h));
  HelloReply reply{};
  ASSERT_TRUE(s.Recv(&reply, sizeof reply));
  EXPECT_EQ(reply.status, 0);
  EXPECT_EQ(reply.handshake_revision, kHandshakeRevisionPlain);
  EXPECT_EQ(reply.message_bytes, 0u);
}

TEST_F(HandshakeTest, ValidMetadataIsAccepted) {
  std::string message;
  const HelloReply v = Exchange(0x6161, MetadataOf(0x6161), &message);
  EXPECT_EQ(v.status, 0) << message;
  EXPECT_EQ(v.engine_id, peer_->engine_id);
}

TEST_F(HandshakeTest, AnotherEnginesMetadataIsRefusedNamingBoth) {
  std::string message;
  const HelloReply v = Exchange(0x7171, MetadataOf(0x7272), &message);
  EXPECT_EQ(v.status, static_cast<uint16_t>(StatusCode::kInvalidArgument)) << message;
  EXPECT_NE(message.find("0000000000007171"), std::string::npos) << message;
  EXPECT_NE(message.find("0000000000007272"), std::string::npos) << message;
}

TEST_F(HandshakeTest, GarbageMetadataIsRefused) {
  Bytes junk(300);
  for (size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<uint8_t>(i * 7 + 1);
  std::string message;
  const HelloReply v = Exchange(0x8181, junk, &message);
  EXPECT_EQ(v.status, static_cast<uint16_t>(StatusCode::kInvalidArgument)) << message;
  EXPECT_NE(message.find("not Ferry engine metadata"), std::string::npos) << message;
}

TEST_F(HandshakeTest, MetadataOfAnotherProtocolVersionIsRefusedNamingBoth) {
  std::string message;
  const HelloReply v = Exchange(0x9191, MetadataOf(0x9191, kProtocolVersion + 6), &message);
  EXPECT_EQ(v.status, static_cast<uint16_t>(StatusCode::kProtocolError)) << message;
  const Status as_status(StatusCode::kProtocolError, message);
  EXPECT_TRUE(NamesNumber(as_status, kProtocolVersion + 6)) << message;
  EXPECT_TRUE(NamesNumber(as_status, kProtocolVersion)) << message;
}

TEST_F(HandshakeTest, ImpossibleMetadataSizeIsRefusedAtOnce) {
  Socket s(peer_->listen);
  ASSERT_TRUE(s.ok());
  Hello h = MakeHello(0xA1A1, kHandshakeRevisionMetadata, kMaxHelloMetadata + 1);
  ASSERT_TRUE(s.Send(&h, sizeof h));
  HelloReply reply{};
  ASSERT_TRUE(s.Recv(&reply, sizeof reply));
  EXPECT_EQ(reply.status, static_cast<uint16_t>(StatusCode::kProtocolError));
  std::string message(std::min(reply.message_bytes, kMaxHelloMessage), '\0');
  ASSERT_TRUE(s.Recv(message.data(), message.size()));
  const Status as_status(StatusCode::kProtocolError, message);
  EXPECT_TRUE(NamesNumber(as_status, kMaxHelloMetadata + 1)) << message;
  EXPECT_TRUE(s.Closed());
}

// An accepting side that answers each stream with `reply` and, after it,
// `follow` bytes; it then waits for the connector to go.
class FakeAcceptor {
 public:
  FakeAcceptor(HelloReply reply, Bytes follow) : reply_(reply), follow_(std::move(follow)) {
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
        auto s = std::make_unique<Socket>(c);  // kept open: the engine opens several streams
        Hello h{};
        if (!s->Recv(&h, sizeof h)) continue;
        s->Send(&reply_, sizeof reply_);
        s->Send(follow_.data(), follow_.size());
        open_.push_back(std::move(s));
      }
    });
  }
  ~FakeAcceptor() {
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  HelloReply reply_;
  Bytes follow_;
  int fd_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
  std::vector<std::unique_ptr<Socket>> open_;
};

TEST(HandshakeConnect, AcceptorSendingAnotherEnginesMetadataIsRefused) {
  const Bytes meta = MetadataOf(0xB2B2);
  HelloReply r{kHelloMagic,
               kProtocolVersion,
               0,
               0xB1B1,
               static_cast<uint32_t>(meta.size()),
               kHandshakeRevisionMetadata,
               0};
  FakeAcceptor fake(r, meta);
  auto e = MakeEngine({{"tcp.connect_timeout_ms", "3000"}});
  ASSERT_TRUE(e);
  auto p = e->connect(std::string_view(fake.address()));
  ASSERT_FALSE(p.ok()) << "accepted metadata naming another engine";
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status().to_string();
  EXPECT_NE(p.status().message().find("000000000000b1b1"), std::string::npos)
      << p.status().to_string();
  EXPECT_NE(p.status().message().find("000000000000b2b2"), std::string::npos)
      << p.status().to_string();
}

TEST(HandshakeConnect, AcceptorClaimingRevisionTwoWithoutMetadataIsAProtocolError) {
  HelloReply r{kHelloMagic, kProtocolVersion, 0, 0xC1C1, 0, kHandshakeRevisionMetadata, 0};
  FakeAcceptor fake(r, {});
  auto e = MakeEngine({{"tcp.connect_timeout_ms", "3000"}});
  ASSERT_TRUE(e);
  auto p = e->connect(std::string_view(fake.address()));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kProtocolError) << p.status().to_string();
}

TEST(HandshakeConnect, AcceptorOfRevisionZeroConnectsOverTcp) {
  // An engine from before revisions (the reply's revision field 0, nothing
  // following): connected, tcp only, with the reason for the rest.
  HelloReply r{kHelloMagic, kProtocolVersion, 0, 0xD1D1, 0, 0, 0};
  FakeAcceptor fake(r, {});
  auto e = MakeEngine();
  ASSERT_TRUE(e);
  auto p = e->connect(std::string_view(fake.address()));
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(*p, 0xD1D1u);
  auto routes = e->peer_transports(*p);
  ASSERT_TRUE(routes.ok());
  for (const auto& t : *routes) {
    if (t.transport == "tcp") {
      EXPECT_TRUE(t.connected);
    } else {
      EXPECT_FALSE(t.connected) << t.transport;
      EXPECT_NE(t.reason.find("handshake revision 1"), std::string::npos) << t.reason;
    }
  }
}

}  // namespace
}  // namespace ferry::itest
