// libFuzzer target: the tcp handshake as a real engine (in this process)
// accepts it over real loopback connections. One input opens one to four
// connections that claim streams of a connection group; each sends a Hello
// built from the input (mostly valid fields, any of them fuzzed), cut short
// or followed by extra bytes; in handshake revision 2 it carries engine
// metadata (valid, corrupted, or any bytes) after the engine's reply.
//
// Invariants checked: no crash or sanitizer report in the engine's threads;
// every reply the engine sends is a well-formed HelloReply (our magic, a
// refusal's message within kMaxHelloMessage); the engine keeps accepting
// connections; the registered region is never written.
#include <arpa/inet.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "core/metadata.h"
#include "engine_fuzz_util.h"
#include "ferry/engine.h"
#include "transport/tcp/tcp_wire.h"

namespace {

using namespace ferry::tcp;

struct Target {
  std::unique_ptr<ferry::Engine> engine;
  std::vector<uint8_t> memory = std::vector<uint8_t>(1 << 12, 0);
  sockaddr_in address{};
};

Target& target() {
  static Target* t = [] {
    auto* t = new Target();
    ferry::EngineConfig config;
    config.options["engine.log_level"] = "off";
    config.options["tcp.io_threads"] = "1";
    // A Hello cut short waits for the handshake deadline: keep it short.
    config.options["tcp.connect_timeout_ms"] = "200";
    config.options["engine.transports"] = "tcp";
    t->engine = std::move(ferry::Engine::create(config).value());
    auto region = t->engine->register_memory(t->memory.data(), t->memory.size()).value();
    (void)t->engine->advertise(region.id).value();
    const std::string listen = t->engine->listen_address();
    t->address.sin_family = AF_INET;
    t->address.sin_port =
        htons(static_cast<uint16_t>(std::stoi(listen.substr(listen.rfind(':') + 1))));
    inet_pton(AF_INET, "127.0.0.1", &t->address.sin_addr);
    return t;
  }();
  return *t;
}

// Connects from a loopback source address of its own: the engine closes
// first, so every connection leaves a TIME_WAIT entry, and thousands a
// second would use up one source address's ports.
int connect_to_target(const Target& t) {
  static uint32_t runs = 0;
  ++runs;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) std::abort();
  sockaddr_in source{};
  source.sin_family = AF_INET;
  source.sin_addr.s_addr = htonl((127u << 24) | (((runs >> 8) % 250 + 1) << 8) | (runs % 250 + 1));
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&source), sizeof source) != 0) {
    std::fprintf(stderr, "fuzz: bind to a loopback source failed: %s\n", std::strerror(errno));
    std::abort();
  }
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&t.address), sizeof t.address) != 0) {
    int error = errno;
    if (error == EINTR) {  // libFuzzer's -timeout alarm: the connect goes on
      pollfd p{fd, POLLOUT, 0};
      while (::poll(&p, 1, 10000) < 0 && errno == EINTR) {
      }
      socklen_t len = sizeof error;
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0) error = errno;
    }
    if (error != 0) {
      std::fprintf(stderr, "fuzz: connect failed: %s\n", std::strerror(error));
      std::abort();  // the engine stopped accepting connections
    }
  }
  return fd;
}

void send_all(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return;  // the engine closed the connection: fine
    p += r;
    n -= static_cast<size_t>(r);
  }
}

// Reads up to `n` bytes: fewer only if the engine closes or stays quiet for
// `quiet_ms`.
std::vector<uint8_t> receive(int fd, size_t n, int quiet_ms) {
  std::vector<uint8_t> got(n);
  size_t have = 0;
  while (have < n) {
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, quiet_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    const ssize_t k = ::recv(fd, got.data() + have, n - have, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    have += static_cast<size_t>(k);
  }
  got.resize(have);
  return got;
}

// The engine answers a Hello with our magic by a HelloReply (accepted, or a
// refusal and its message); anything else it closes without a word. Returns
// the reply if it accepted.
std::optional<HelloReply> check_reply(int fd) {
  const std::vector<uint8_t> got = receive(fd, sizeof(HelloReply), 2000);
  if (got.empty()) return std::nullopt;
  if (got.size() < sizeof(HelloReply)) std::abort();  // a torn reply
  HelloReply reply;
  std::memcpy(&reply, got.data(), sizeof reply);
  if (reply.magic != kHelloMagic || reply.protocol_version != kProtocolVersion) std::abort();
  if (reply.status == 0) return reply;
  if (reply.message_bytes == 0 || reply.message_bytes > kMaxHelloMessage) std::abort();
  if (receive(fd, reply.message_bytes, 2000).size() != reply.message_bytes) std::abort();
  return std::nullopt;
}

// The metadata this side sends in a revision-2 handshake: valid metadata
// naming the claimed engine, now and then with bytes changed, or any bytes.
ferry::Bytes our_metadata(FuzzedDataProvider& in, uint64_t engine_id) {
  if (in.ConsumeBool()) return in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 512));
  ferry::EngineMetadata m;
  m.engine_id = in.ConsumeBool() ? engine_id : in.ConsumeIntegral<uint64_t>();
  m.protocol_version = in.ConsumeBool() ? ferry::kProtocolVersion : in.ConsumeIntegral<uint16_t>();
  m.hostname = in.ConsumeRandomLengthString(64);
  m.host_id = in.ConsumeRandomLengthString(64);
  const auto transports = in.ConsumeIntegralInRange<int>(0, 3);
  for (int t = 0; t < transports; ++t) {
    m.transports.push_back({in.ConsumeRandomLengthString(16),
                            in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 64))});
  }
  ferry::Bytes bytes = m.encode();
  const auto flips = in.ConsumeIntegralInRange<int>(0, 2);
  for (int f = 0; f < flips && !bytes.empty(); ++f) {
    bytes[in.ConsumeIntegralInRange<size_t>(0, bytes.size() - 1)] ^= in.ConsumeIntegral<uint8_t>();
  }
  return bytes;
}

// Revision 2 after an accepted Hello that declared metadata: the engine's
// metadata (it must decode and name the engine), ours, and `extra` bytes
// after it. The second reply comes once the engine has what the Hello
// claimed; a longer claim that those bytes do not fill gets none until the
// handshake deadline, and is not waited for (the engine sees our end of the
// stream at the drain instead). Returns whether `extra` was sent.
bool exchange_metadata(int fd, const HelloReply& reply, uint32_t claimed, const ferry::Bytes& ours,
                       const std::vector<uint8_t>& extra) {
  if (reply.handshake_revision != kHandshakeRevisionMetadata || reply.message_bytes == 0) {
    return false;
  }
  if (reply.message_bytes > kMaxHelloMetadata) std::abort();
  const std::vector<uint8_t> theirs = receive(fd, reply.message_bytes, 2000);
  if (theirs.size() != reply.message_bytes) std::abort();
  auto m = ferry::EngineMetadata::decode(ferry::ByteView(theirs));
  if (!m.ok() || m->engine_id != target().engine->id()) std::abort();
  send_all(fd, ours.data(), ours.size());
  if (ours.size() >= claimed) {
    (void)check_reply(fd);
    return false;
  }
  send_all(fd, extra.data(), extra.size());
  if (ours.size() + extra.size() >= claimed) (void)check_reply(fd);
  return true;
}

// One run: its connections, from connect to the engine's close.
void run(const uint8_t* data, size_t size) {
  Target& t = target();
  FuzzedDataProvider in(data, size);
  const auto streams = in.ConsumeIntegralInRange<uint16_t>(1, 4);
  const uint64_t nonce = in.ConsumeIntegral<uint64_t>();
  const uint64_t engine_id = in.ConsumeIntegralInRange<uint64_t>(0, 5);
  std::vector<int> fds;
  for (uint16_t i = 0; i < streams && in.remaining_bytes() > 0; ++i) {
    Hello hello{kHelloMagic, kProtocolVersion, i, engine_id, nonce, streams, 0, 0};
    // Each field fuzzed now and then, the rest left valid.
    if (in.ConsumeProbability<float>() < 0.05f) hello.magic = in.ConsumeIntegral<uint32_t>();
    if (in.ConsumeProbability<float>() < 0.1f) {
      hello.protocol_version = in.ConsumeIntegral<uint16_t>();
    }
    if (in.ConsumeProbability<float>() < 0.2f) hello.stream_index = in.ConsumeIntegral<uint16_t>();
    if (in.ConsumeProbability<float>() < 0.2f) hello.stream_count = in.ConsumeIntegral<uint16_t>();
    if (in.ConsumeBool()) hello.engine_id = in.ConsumeIntegral<uint64_t>();
    hello.handshake_revision =
        in.ConsumeBool() ? kHandshakeRevision : in.ConsumeIntegral<uint16_t>();
    // Revision 2's metadata: declared as long as it is, or (now and then)
    // any length.
    ferry::Bytes metadata;
    if (in.ConsumeBool()) metadata = our_metadata(in, hello.engine_id);
    hello.metadata_bytes = static_cast<uint32_t>(metadata.size());
    if (in.ConsumeProbability<float>() < 0.02f)
      hello.metadata_bytes = in.ConsumeIntegral<uint32_t>();
    // Cut short now and then: the engine waits for the rest until the drain
    // below ends our side of the stream.
    size_t length = sizeof hello;
    if (in.ConsumeProbability<float>() < 0.02f) length = in.ConsumeIntegralInRange<size_t>(0, 31);
    const auto extra = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 64));
    const int fd = connect_to_target(t);
    fds.push_back(fd);
    send_all(fd, reinterpret_cast<const uint8_t*>(&hello), length);
    bool extra_sent = false;
    if (length == sizeof hello && hello.magic == kHelloMagic) {
      if (auto reply = check_reply(fd)) {
        extra_sent = exchange_metadata(fd, *reply, hello.metadata_bytes, metadata, extra);
      }
    }
    if (!extra_sent && !extra.empty()) send_all(fd, extra.data(), extra.size());
  }
  for (int fd : fds) {
    ::shutdown(fd, SHUT_WR);
    (void)receive(fd, 1 << 16, 300);  // until the engine closes it
    ::close(fd);
  }
  if (!ferry::fuzz::untouched(t.memory)) std::abort();  // a handshake wrote into the region
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ferry::fuzz::EngineSettle settle;
  run(data, size);
  (void)settle.wait(std::chrono::milliseconds(1), std::chrono::milliseconds(20));
  return 0;
}
