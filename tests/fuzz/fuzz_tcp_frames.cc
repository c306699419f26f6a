// libFuzzer target: a real engine (in this process) receives fuzzed frames
// over a real loopback TCP connection after a valid handshake. The frames are
// built from the input with mostly-consistent sizes so the fuzzer reaches the
// segment checks and payload placement, not only the header check.
//
// Invariants checked: no crash or sanitizer report in the engine's threads;
// the registered region is never written (no input can know its key); the
// engine keeps accepting connections.
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
#include <vector>

#include "engine_fuzz_util.h"
#include "ferry/engine.h"
#include "transport/tcp/tcp_wire.h"

namespace {

struct Target {
  std::unique_ptr<ferry::Engine> engine;
  std::vector<uint8_t> memory = std::vector<uint8_t>(1 << 16, 0);
  ferry::RemoteDescriptor desc;
  sockaddr_in address{};
};

Target& target() {
  static Target* t = [] {
    auto* t = new Target();
    ferry::EngineConfig config;
    config.options["engine.log_level"] = "off";
    config.options["tcp.io_threads"] = "1";
    // The frames under test are tcp's; other transports (libfabric's
    // providers, with their own threads and signal handlers) only add noise.
    config.options["engine.transports"] = "tcp";
    t->engine = std::move(ferry::Engine::create(config).value());
    auto region = t->engine->register_memory(t->memory.data(), t->memory.size()).value();
    t->desc = t->engine->advertise(region.id).value();
    const std::string listen = t->engine->listen_address();
    t->address.sin_family = AF_INET;
    t->address.sin_port =
        htons(static_cast<uint16_t>(std::stoi(listen.substr(listen.rfind(':') + 1))));
    inet_pton(AF_INET, "127.0.0.1", &t->address.sin_addr);
    return t;
  }();
  return *t;
}

void append(std::vector<uint8_t>& out, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}

std::vector<uint8_t> build_stream(FuzzedDataProvider& in, const Target& t) {
  using namespace ferry::tcp;
  std::vector<uint8_t> out;
  Hello hello{kHelloMagic, kProtocolVersion, 0, 0x1234, 77, 1, 0, 0};
  if (in.ConsumeBool()) hello.protocol_version = in.ConsumeIntegral<uint16_t>();
  hello.engine_id = in.ConsumeIntegralInRange<uint64_t>(0, 3);
  append(out, &hello, sizeof hello);
  while (in.remaining_bytes() > 0) {
    FrameHeader h{};
    h.magic = in.ConsumeProbability<float>() < 0.95f ? kFrameMagic : in.ConsumeIntegral<uint16_t>();
    h.op = in.ConsumeIntegralInRange<uint8_t>(0, 7);
    h.count = in.ConsumeIntegralInRange<uint32_t>(0, 4);
    h.transfer_id = in.ConsumeIntegral<uint8_t>();
    h.status = in.ConsumeIntegralInRange<uint32_t>(0, 14);
    std::vector<WireSegment> segs(h.count);
    uint64_t total = 0;
    for (auto& s : segs) {
      s.region_id = in.ConsumeBool() ? t.desc.region_id : in.ConsumeIntegral<uint64_t>();
      s.adv_offset = in.ConsumeBool() ? 0 : in.ConsumeIntegral<uint64_t>();
      s.adv_length = in.ConsumeBool() ? t.desc.length : in.ConsumeIntegral<uint64_t>();
      s.key = in.ConsumeIntegral<uint64_t>();  // never the real key
      s.access = in.ConsumeIntegralInRange<uint8_t>(0, 4);
      s.offset = in.ConsumeIntegralInRange<uint64_t>(0, 1 << 17);
      s.length = in.ConsumeIntegralInRange<uint64_t>(0, 4096);
      total += s.length;
    }
    h.aux_bytes = in.ConsumeBool() ? h.count * sizeof(WireSegment)
                                   : in.ConsumeIntegralInRange<uint32_t>(0, 512);
    h.payload_bytes = in.ConsumeBool() ? total : in.ConsumeIntegralInRange<uint64_t>(0, 8192);
    append(out, &h, sizeof h);
    if (!segs.empty()) append(out, segs.data(), segs.size() * sizeof(WireSegment));
    const size_t tail = in.ConsumeIntegralInRange<size_t>(0, 8192);
    auto bytes = in.ConsumeBytes<uint8_t>(tail);
    out.insert(out.end(), bytes.begin(), bytes.end());
  }
  return out;
}

// One run: its connection, from connect to the engine's close.
void run(const uint8_t* data, size_t size) {
  Target& t = target();
  FuzzedDataProvider in(data, size);
  const std::vector<uint8_t> stream = build_stream(in, t);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) std::abort();
  // The engine closes first, so every run leaves a TIME_WAIT entry; thousands
  // of runs a second would use up one source address's ports. Spread the
  // source over 127.0.0.0/8.
  static uint32_t runs = 0;
  ++runs;
  sockaddr_in source{};
  source.sin_family = AF_INET;
  source.sin_addr.s_addr = htonl((127u << 24) | (((runs >> 8) % 250 + 1) << 8) | (runs % 250 + 1));
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&source), sizeof source) != 0) {
    std::fprintf(stderr, "fuzz: bind to a loopback source failed: %s\n", std::strerror(errno));
    std::abort();
  }
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&t.address), sizeof t.address) != 0) {
    // libFuzzer's -timeout alarm (SIGALRM) can interrupt a blocking connect;
    // the connection then completes on its own: wait for it and read its result.
    int error = errno;
    if (error == EINTR) {
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
  size_t sent = 0;
  while (sent < stream.size()) {
    const ssize_t n = ::send(fd, stream.data() + sent, stream.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the engine closed the connection: fine
    sent += static_cast<size_t>(n);
  }
  ::shutdown(fd, SHUT_WR);
  char sink[256];
  for (;;) {
    const ssize_t n = ::recv(fd, sink, sizeof sink, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
  }
  ::close(fd);
  // Take what the frames delivered, as an application would: notifications
  // left in the engine would pile up over millions of runs.
  (void)t.engine->take_notifications();
  // A frame without the key wrote into the region?
  if (!ferry::fuzz::untouched(t.memory)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ferry::fuzz::EngineSettle settle;
  run(data, size);
  (void)settle.wait(std::chrono::milliseconds(1), std::chrono::milliseconds(20));
  return 0;
}
