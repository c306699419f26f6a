// tcp transport: connection set-up -- each stream's handshake, on the
// connecting side (connect, open_group) and on the accepting side (on_accept,
// rx_hello, rx_hello_metadata). The messages are in tcp_wire.h, the prose in
// docs/protocol.md ("Handshake").
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "core/random_bytes.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/tcp/tcp_transport.h"

namespace ferry::tcp {
namespace {

std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

// A HelloReply with a non-zero status: its message follows it on `fd`.
Status refused(int fd, const HelloReply& reply, const std::string& remote,
               std::chrono::milliseconds timeout) {
  std::string message(std::min(reply.message_bytes, kMaxHelloMessage), '\0');
  (void)recv_all(fd, message.data(), message.size(), timeout);
  const auto code = reply.status <= static_cast<uint16_t>(StatusCode::kInternal)
                        ? static_cast<StatusCode>(reply.status)
                        : StatusCode::kProtocolError;
  return Status(code, fmt::format("{} refused the connection: {}", remote, message));
}

}  // namespace

// --------------------------------------------------------------- connect ---

Result<PeerId> TcpTransport::connect(ByteView peer_address, PeerId expected_peer) {
  const std::string text(peer_address.begin(), peer_address.end());
  if (text.empty()) return err::InvalidArgument("peer has no tcp address");
  std::lock_guard serial(connect_mu_);
  if (expected_peer != 0 && is_connected(expected_peer)) return expected_peer;
  Status last;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    const std::string one = text.substr(start, comma - start);
    start = comma + 1;
    auto resolved = resolve(one);
    if (!resolved.ok()) {
      last = resolved.status();
      continue;
    }
    for (const auto& address : *resolved) {
      auto group = open_group(address, expected_peer);
      if (group.ok()) return (*group)->peer;
      last = group.status();
      // A refusal by a live Ferry engine (version, identity) is final.
      if (last.code() == StatusCode::kProtocolError ||
          last.code() == StatusCode::kInvalidArgument) {
        return last;
      }
    }
  }
  return last;
}

Result<PeerId> TcpTransport::handshake_out(int fd, const Group& group, uint32_t index,
                                           ByteView metadata, PeerId expected_peer) {
  const auto timeout = opt_.connect_timeout;
  Hello hello{kHelloMagic,
              kProtocolVersion,
              static_cast<uint16_t>(index),
              ctx_.engine_id,
              group.nonce,
              static_cast<uint16_t>(opt_.streams),
              opt_.handshake_revision,
              static_cast<uint32_t>(metadata.size())};
  HelloReply reply{};
  Status s = send_all(fd, &hello, sizeof hello, timeout);
  if (s.ok()) s = recv_all(fd, &reply, sizeof reply, timeout);
  if (!s.ok()) {
    return err::PeerDisconnected(
        fmt::format("handshake with {} failed: {}", group.remote, s.message()));
  }
  if (reply.magic != kHelloMagic) {
    return err::ProtocolError(fmt::format(
        "{} is not a Ferry engine (handshake reply magic {:#010x})", group.remote, reply.magic));
  }
  if (reply.status != 0) return refused(fd, reply, group.remote, timeout);
  if (reply.protocol_version != kProtocolVersion) {
    return err::ProtocolError(
        fmt::format("protocol version mismatch with {}: peer speaks {}, this engine speaks {}",
                    group.remote, reply.protocol_version, kProtocolVersion));
  }
  if (expected_peer != 0 && reply.engine_id != expected_peer) {
    return err::InvalidArgument(fmt::format("{} is engine {}, but the metadata names engine {}",
                                            group.remote, hex_id(reply.engine_id),
                                            hex_id(expected_peer)));
  }
  const uint16_t agreed = effective_revision(reply.handshake_revision);
  if (agreed < kHandshakeRevisionMetadata) {
    // Revision 1 (an engine from before revision 2, one that runs with
    // tcp.handshake_revision=1, or a stream that carries no metadata).
    if (reply.message_bytes != 0) {
      return err::ProtocolError(
          fmt::format("{} accepted the handshake with {} bytes following (revision {})",
                      group.remote, reply.message_bytes, agreed));
    }
    return reply.engine_id;
  }
  if (metadata.empty() || agreed > opt_.handshake_revision || reply.message_bytes == 0 ||
      reply.message_bytes > kMaxHelloMetadata) {
    return err::ProtocolError(fmt::format(
        "{} answered handshake revision {} with {} bytes of metadata; this engine offered "
        "revision {} with {} bytes (limit {})",
        group.remote, agreed, reply.message_bytes, opt_.handshake_revision, metadata.size(),
        kMaxHelloMetadata));
  }
  // Revision 2: the peer's metadata, checked as connect(metadata) checks it;
  // then ours, and the peer's verdict on it.
  Bytes theirs(reply.message_bytes);
  if (Status r = recv_all(fd, theirs.data(), theirs.size(), timeout); !r.ok()) {
    return err::PeerDisconnected(fmt::format("handshake with {}: its metadata did not arrive: {}",
                                             group.remote, r.message()));
  }
  if (ctx_.peer_metadata) {
    if (Status v = ctx_.peer_metadata(reply.engine_id, ByteView(theirs)); !v.ok()) {
      return Status(v.code(), fmt::format("handshake with {}: the metadata it sent: {}",
                                          group.remote, v.message()));
    }
  }
  HelloReply verdict{};
  s = send_all(fd, metadata.data(), metadata.size(), timeout);
  if (s.ok()) s = recv_all(fd, &verdict, sizeof verdict, timeout);
  if (!s.ok()) {
    return err::PeerDisconnected(fmt::format(
        "handshake with {} failed after the metadata exchange: {}", group.remote, s.message()));
  }
  if (verdict.magic != kHelloMagic) {
    return err::ProtocolError(
        fmt::format("{}: bad handshake verdict (magic {:#010x})", group.remote, verdict.magic));
  }
  if (verdict.status != 0) return refused(fd, verdict, group.remote, timeout);
  return reply.engine_id;
}

Result<std::shared_ptr<Group>> TcpTransport::open_group(const SocketAddress& address,
                                                        PeerId expected_peer) {
  auto group = std::make_shared<Group>();
  group->outgoing = true;
  group->remote = address.to_string();
  if (Status s = random_bytes(&group->nonce, sizeof group->nonce); !s.ok()) return s;
  // Our metadata rides on the first stream, for a peer that speaks revision 2.
  Bytes metadata;
  if (opt_.handshake_revision >= kHandshakeRevisionMetadata && ctx_.local_metadata) {
    metadata = ctx_.local_metadata();
    if (metadata.size() > kMaxHelloMetadata) metadata.clear();
  }
  std::vector<int> fds;
  auto close_all = [&] {
    for (int fd : fds) ::close(fd);
  };
  for (uint32_t i = 0; i < opt_.streams; ++i) {
    auto fd = connect_to(address, opt_.connect_timeout);
    if (!fd.ok()) {
      close_all();
      return fd.status();
    }
    fds.push_back(*fd);
    tune_stream_socket(*fd, opt_.user_timeout, opt_.sndbuf, opt_.rcvbuf);
    auto peer =
        handshake_out(*fd, *group, i, i == 0 ? ByteView(metadata) : ByteView(), expected_peer);
    if (!peer.ok()) {
      close_all();
      return peer.status();
    }
    if (i > 0 && *peer != group->peer) {
      close_all();
      return err::ProtocolError(fmt::format("{}: stream {} reached engine {}, stream 0 engine {}",
                                            group->remote, i, hex_id(*peer), hex_id(group->peer)));
    }
    group->peer = *peer;
  }
  for (size_t i = 0; i < fds.size(); ++i) {
    auto s = std::make_shared<Stream>();
    s->fd = fds[i];
    s->remote = group->remote;
    s->group = group;
    group->streams.push_back(s);
  }
  group->arrived = fds.size();
  {
    std::lock_guard lock(mu_);
    groups_[{group->peer, group->nonce}] = group;
    auto& slot = primary_[group->peer];
    if (!slot || slot->dead.load()) slot = group;
  }
  for (auto& s : group->streams) {
    workers_[next_worker_.fetch_add(1) % workers_.size()]->adopt(s);
  }
  ctx_.events->on_peer_up(group->peer);
  spdlog::debug("ferry tcp: connected to engine {} at {} with {} streams", hex_id(group->peer),
                group->remote, group->streams.size());
  return group;
}

// ---------------------------------------------------------------- accept ---

void TcpTransport::on_accept(int listen_fd) {
  for (;;) {
    sockaddr_storage from{};
    socklen_t len = sizeof from;
    const int fd =
        accept4(listen_fd, reinterpret_cast<sockaddr*>(&from), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        spdlog::warn("ferry tcp: accept failed: {}", errno_text(errno));
      }
      return;
    }
    SocketAddress a;
    a.storage = from;
    a.length = len;
    tune_stream_socket(fd, opt_.user_timeout, opt_.sndbuf, opt_.rcvbuf);
    auto s = std::make_shared<Stream>();
    s->fd = fd;
    s->remote = a.to_string();
    s->rx = Stream::Rx::kHello;
    s->hello_deadline = std::chrono::steady_clock::now() + opt_.connect_timeout;
    workers_[next_worker_.fetch_add(1) % workers_.size()]->adopt(s);
  }
}

bool TcpTransport::refuse_hello(Stream& s, StatusCode code, const std::string& why) {
  hostile_log_.log(spdlog::level::warn,
                   fmt::format("ferry tcp: refusing connection from {}: {}", s.remote, why));
  HelloReply reply{kHelloMagic,
                   kProtocolVersion,
                   static_cast<uint16_t>(code),
                   ctx_.engine_id,
                   static_cast<uint32_t>(std::min<size_t>(why.size(), kMaxHelloMessage)),
                   0,
                   0};
  (void)send_all(s.fd, &reply, sizeof reply, std::chrono::milliseconds(100));
  (void)send_all(s.fd, why.data(), reply.message_bytes, std::chrono::milliseconds(100));
  fail_stream(s, err::ProtocolError(why));
  return false;
}

bool TcpTransport::rx_hello(Stream& s) {
  const ssize_t r = ::recv(s.fd, s.head + s.head_got, sizeof(Hello) - s.head_got, 0);
  if (r <= 0) {
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return false;
    hostile_log_.log(
        spdlog::level::info,
        fmt::format("ferry tcp: connection from {} closed during the handshake", s.remote));
    fail_stream(s, err::PeerDisconnected("closed during handshake"));
    return false;
  }
  s.head_got += static_cast<size_t>(r);
  if (s.head_got < sizeof(Hello)) return true;
  s.head_got = 0;
  Hello hello;
  std::memcpy(&hello, s.head, sizeof hello);
  if (hello.magic != kHelloMagic) {
    hostile_log_.log(spdlog::level::warn,
                     fmt::format("ferry tcp: closing connection from {}: not a Ferry handshake "
                                 "(magic {:#010x})",
                                 s.remote, hello.magic));
    fail_stream(s, err::ProtocolError("bad handshake magic"));
    return false;
  }
  if (hello.protocol_version != kProtocolVersion) {
    return refuse_hello(
        s, StatusCode::kProtocolError,
        fmt::format("protocol version mismatch: peer speaks {}, this engine speaks {}",
                    hello.protocol_version, kProtocolVersion));
  }
  if (hello.engine_id == 0 || hello.stream_count == 0 || hello.stream_count > 64 ||
      hello.stream_index >= hello.stream_count) {
    return refuse_hello(
        s, StatusCode::kProtocolError,
        fmt::format("malformed handshake: engine {}, stream {} of {}", hex_id(hello.engine_id),
                    hello.stream_index, hello.stream_count));
  }
  // Revision 2 with a Hello that declares metadata: ours follows the reply,
  // theirs comes next (rx_hello_metadata). Revision 1 otherwise -- also when
  // this engine is still starting and has no metadata to give.
  const uint16_t agreed =
      std::min(effective_revision(hello.handshake_revision), opt_.handshake_revision);
  Bytes metadata;
  if (agreed >= kHandshakeRevisionMetadata && hello.metadata_bytes > 0) {
    if (hello.metadata_bytes > kMaxHelloMetadata) {
      return refuse_hello(s, StatusCode::kProtocolError,
                          fmt::format("handshake declares {} bytes of metadata (limit {})",
                                      hello.metadata_bytes, kMaxHelloMetadata));
    }
    if (ctx_.local_metadata) metadata = ctx_.local_metadata();
    if (metadata.size() > kMaxHelloMetadata) metadata.clear();
  }
  std::shared_ptr<Group> group;
  bool duplicate = false;
  {
    std::lock_guard lock(mu_);
    auto& g = groups_[{hello.engine_id, hello.group_nonce}];
    if (!g) {
      g = std::make_shared<Group>();
      g->peer = hello.engine_id;
      g->nonce = hello.group_nonce;
      g->remote = s.remote;
      g->streams.resize(hello.stream_count);
    }
    group = g;
    duplicate = group->streams.size() != hello.stream_count || group->streams[hello.stream_index];
    if (!duplicate) group->streams[hello.stream_index] = s.shared_from_this();
  }
  if (duplicate) {
    return refuse_hello(s, StatusCode::kProtocolError,
                        fmt::format("stream {} of {} arrived twice or with a different count",
                                    hello.stream_index, hello.stream_count));
  }
  s.group = group;
  const bool exchange = !metadata.empty();
  HelloReply reply{kHelloMagic,
                   kProtocolVersion,
                   0,
                   ctx_.engine_id,
                   static_cast<uint32_t>(metadata.size()),
                   exchange ? kHandshakeRevisionMetadata : kHandshakeRevisionPlain,
                   0};
  Status sent = send_all(s.fd, &reply, sizeof reply, opt_.connect_timeout);
  if (sent.ok() && exchange)
    sent = send_all(s.fd, metadata.data(), metadata.size(), opt_.connect_timeout);
  if (!sent.ok()) {
    fail_stream(s, sent);
    return false;
  }
  if (exchange) {
    s.rx = Stream::Rx::kHelloMetadata;
    s.aux.assign(hello.metadata_bytes, 0);
    s.aux_got = 0;
    return true;
  }
  stream_arrived(s, group);
  return true;
}

bool TcpTransport::rx_hello_metadata(Stream& s) {
  const ssize_t r = ::recv(s.fd, s.aux.data() + s.aux_got, s.aux.size() - s.aux_got, 0);
  if (r <= 0) {
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return false;
    hostile_log_.log(
        spdlog::level::info,
        fmt::format("ferry tcp: connection from {} closed during the handshake", s.remote));
    fail_stream(s, err::PeerDisconnected("closed during handshake"));
    return false;
  }
  s.aux_got += static_cast<size_t>(r);
  if (s.aux_got < s.aux.size()) return true;
  auto group = s.group.lock();
  if (!group) {
    fail_stream(s, err::PeerDisconnected("connection group gone during the handshake"));
    return false;
  }
  Status verdict = Status::Ok();
  if (ctx_.peer_metadata) verdict = ctx_.peer_metadata(group->peer, ByteView(s.aux));
  s.aux.clear();
  s.aux_got = 0;
  if (!verdict.ok()) {
    return refuse_hello(s, verdict.code(),
                        fmt::format("the metadata engine {} sent in the handshake: {}",
                                    hex_id(group->peer), verdict.message()));
  }
  HelloReply ok{kHelloMagic, kProtocolVersion, 0, ctx_.engine_id, 0, kHandshakeRevisionMetadata, 0};
  if (Status st = send_all(s.fd, &ok, sizeof ok, opt_.connect_timeout); !st.ok()) {
    fail_stream(s, st);
    return false;
  }
  stream_arrived(s, group);
  return true;
}

void TcpTransport::stream_arrived(Stream& s, const std::shared_ptr<Group>& group) {
  bool complete = false;
  {
    std::lock_guard lock(mu_);
    complete = ++group->arrived == group->streams.size();
    if (complete) {
      auto& slot = primary_[group->peer];
      if (!slot || slot->dead.load()) slot = group;
    }
  }
  s.rx = Stream::Rx::kHeader;
  if (complete) ctx_.events->on_peer_up(group->peer);
}

}  // namespace ferry::tcp
