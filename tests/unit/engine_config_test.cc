// Engine creation, options and local (no peer) API behaviour through the
// public header only.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <set>
#include <vector>

#include "ferry/engine.h"

namespace ferry {
namespace {

bool Contains(const std::string& s, std::string_view what) {
  return s.find(what) != std::string::npos;
}

// A copy: Engine::options() returns a temporary.
std::optional<OptionInfo> Find(const std::vector<OptionInfo>& all, std::string_view name) {
  for (const auto& o : all) {
    if (o.name == name) return o;
  }
  return std::nullopt;
}

class EngineConfigTest : public ::testing::Test {
 protected:
  void SetUp() override { unsetenv("FERRY_TCP_STREAMS"); }
  void TearDown() override { unsetenv("FERRY_TCP_STREAMS"); }
};

TEST_F(EngineConfigTest, DefaultsAndListenAddress) {
  auto e = Engine::create();
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_NE((*e)->id(), 0u);
  const std::string addr = (*e)->listen_address();
  ASSERT_EQ(addr.rfind("127.0.0.1:", 0), 0u) << addr;
  EXPECT_NE(addr, "127.0.0.1:0") << "port 0 must be resolved to the bound port";
  EXPECT_FALSE((*e)->metadata().empty());
  auto streams = Find((*e)->options(), "tcp.streams");
  ASSERT_TRUE(streams.has_value());
  EXPECT_EQ(streams->source, "default");
  EXPECT_FALSE(streams->doc.empty());
  EXPECT_FALSE(version().empty());
  EXPECT_GE(protocol_version(), 1);
}

TEST_F(EngineConfigTest, EngineIdsAreUnique) {
  std::set<uint64_t> ids;
  std::vector<std::unique_ptr<Engine>> engines;
  for (int i = 0; i < 8; ++i) {
    auto e = Engine::create();
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    ids.insert((*e)->id());
    engines.push_back(std::move(e.value()));
  }
  EXPECT_EQ(ids.size(), 8u);
}

TEST_F(EngineConfigTest, UnknownOptionIsAnError) {
  EngineConfig c;
  c.options["tcp.strems"] = "4";
  auto e = Engine::create(c);
  ASSERT_FALSE(e.ok()) << "a misspelt option was silently ignored";
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(e.status().message(), "tcp.strems")) << e.status().to_string();
}

TEST_F(EngineConfigTest, InvalidValueIsAnError) {
  for (const char* v : {"65", "abc", "-1", "100000"}) {
    EngineConfig c;
    c.options["tcp.streams"] = v;
    auto e = Engine::create(c);
    ASSERT_FALSE(e.ok()) << "tcp.streams=" << v << " accepted";
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(e.status().message(), "tcp.streams")) << e.status().to_string();
    EXPECT_TRUE(Contains(e.status().message(), v)) << e.status().to_string();
  }
}

TEST_F(EngineConfigTest, EnvironmentAndConfigPrecedence) {
  setenv("FERRY_TCP_STREAMS", "3", 1);
  auto from_env = Engine::create();
  ASSERT_TRUE(from_env.ok()) << from_env.status().to_string();
  auto o = Find((*from_env)->options(), "tcp.streams");
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->value, "3");
  EXPECT_TRUE(Contains(o->source, "FERRY_TCP_STREAMS")) << o->source;

  EngineConfig c;
  c.options["tcp.streams"] = "5";
  auto from_config = Engine::create(c);
  ASSERT_TRUE(from_config.ok()) << from_config.status().to_string();
  o = Find((*from_config)->options(), "tcp.streams");
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->value, "5");
  EXPECT_EQ(o->source, "config");

  setenv("FERRY_TCP_STREAMS", "many", 1);
  auto bad = Engine::create();
  ASSERT_FALSE(bad.ok()) << "FERRY_TCP_STREAMS=many was ignored";
  EXPECT_TRUE(Contains(bad.status().message(), "many")) << bad.status().to_string();
}

TEST_F(EngineConfigTest, BadListenAddressesFailCleanly) {
  for (const char* listen : {"999.1.1.1:0", "127.0.0.1:99999", "not an address:0"}) {
    EngineConfig c;
    c.listen = listen;
    auto e = Engine::create(c);
    EXPECT_FALSE(e.ok()) << "listen '" << listen << "' accepted";
  }
}

TEST_F(EngineConfigTest, PortInUseIsAnError) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof sa;
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  EngineConfig c;
  c.listen = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
  auto e = Engine::create(c);
  EXPECT_FALSE(e.ok()) << "listening on a port that is taken succeeded";
  close(fd);
}

TEST_F(EngineConfigTest, LocalMemoryCalls) {
  auto e = Engine::create();
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  std::vector<uint8_t> buf(1 << 16);
  EXPECT_EQ(engine.register_memory(nullptr, 16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.register_memory(buf.data(), 0).status().code(), StatusCode::kInvalidArgument);
  auto r = engine.register_memory(buf.data(), buf.size());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->kind, MemoryKind::kHost);
  auto d = engine.advertise(r->id, 100, 200, kAccessRead);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->engine_id, engine.id());
  EXPECT_EQ(d->length, 200u);
  EXPECT_EQ(engine.advertise(r->id, 0, buf.size() + 1).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(engine.advertise(r->id + 100).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(engine.deregister_memory(r->id).ok());
  EXPECT_EQ(engine.deregister_memory(r->id).code(), StatusCode::kNotFound);
  EXPECT_EQ(engine.advertise(r->id).status().code(), StatusCode::kNotFound);
  auto again = engine.register_memory(buf.data(), buf.size());
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->id, r->id) << "region ids must never be reused";
}

TEST_F(EngineConfigTest, NoPeerYet) {
  auto e = Engine::create();
  ASSERT_TRUE(e.ok());
  std::vector<uint8_t> buf(64);
  ASSERT_TRUE((*e)->register_memory(buf.data(), buf.size()).ok());
  RemoteDescriptor d;
  d.engine_id = 0x1234;
  d.length = 64;
  LocalIov l{buf.data(), 8};
  RemoteIov r{&d, 0, 8};
  Status s = (*e)->write(0x1234, {&l, 1}, {&r, 1});
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
  EXPECT_TRUE((*e)->peers().empty());
  EXPECT_EQ((*e)->peer_address(0x1234).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE((*e)->take_notifications().empty());
  const uint8_t payload[] = {1};
  EXPECT_FALSE((*e)->notify(0x1234, payload).ok());
}

TEST(StatusNames, EveryCodeHasADistinctName) {
  std::set<std::string> names;
  for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
    const auto name = status_code_name(static_cast<StatusCode>(c));
    EXPECT_FALSE(name.empty()) << c;
    names.insert(std::string(name));
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(StatusCode::kInternal) + 1);
  EXPECT_EQ(status_code_name(StatusCode::kPeerDisconnected), "PeerDisconnected");
  const Status s = err::OutOfRange("region 7: op [9, +2)");
  EXPECT_TRUE(Contains(s.to_string(), "OutOfRange")) << s.to_string();
  EXPECT_TRUE(Contains(s.to_string(), "region 7: op [9, +2)")) << s.to_string();
}

}  // namespace
}  // namespace ferry
