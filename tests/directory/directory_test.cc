// The metadata directory against a real etcd (Debian etcd-server) on
// loopback: engines in separate processes find each other by name and move
// verified data; leases expire after SIGKILL; a held name is refused; etcd
// killed and restarted mid-run. Skipped, with the reason, without etcd.
#include "ferry/directory.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <set>
#include <thread>

#include "etcd_server.h"
#include "ferry/engine.h"
#include "test_util.h"

#ifndef FERRY_DIRECTORY_PEER_PATH
#define FERRY_DIRECTORY_PEER_PATH "ferry_directory_peer"
#endif

namespace ferry::dtest {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int kTtl = 2;  // seconds; etcd's minimum lease ttl with default timing
constexpr uint64_t kBufSize = 8 << 20;

DirectoryOptions FastOptions() {
  DirectoryOptions o;
  o.lease_ttl = std::chrono::seconds(kTtl);
  o.connect_timeout = 300ms;
  o.request_timeout = 1500ms;
  return o;
}

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Polls `f` every 100 ms until it returns true or `limit` passes.
template <typename F>
bool Eventually(std::chrono::milliseconds limit, F&& f) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (f()) return true;
    std::this_thread::sleep_for(100ms);
  }
  return f();
}

// One running ferry_directory_peer.
struct Target {
  std::unique_ptr<itest::ChildProcess> child;
  pid_t pid = -1;

  static std::unique_ptr<Target> Start(const std::string& url, const std::string& name,
                                       std::string* error, int ttl = kTtl) {
    auto t = std::make_unique<Target>();
    t->child = itest::ChildProcess::Spawn(
        {FERRY_DIRECTORY_PEER_PATH, url, name, std::to_string(kBufSize), std::to_string(ttl)},
        error);
    if (!t->child) return nullptr;
    auto line = t->child->ReadLine(30s);
    if (!line || line->rfind("READY ", 0) != 0) {
      *error = "ferry_directory_peer did not get ready: " + line.value_or("<no output>");
      return nullptr;
    }
    t->pid = std::stoi(line->substr(6));
    return t;
  }
  std::string Command(const std::string& line) {
    if (!child->SendLine(line)) return "<send failed>";
    return child->ReadLine(30s).value_or("<no reply>");
  }
};

class DirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (FindEtcd().empty()) {
      GTEST_SKIP() << "etcd is not installed (Debian package etcd-server; or set FERRY_ETCD to "
                      "its path): the directory tests need a real etcd server";
    }
    std::string error;
    ASSERT_TRUE(etcd_.Start(&error)) << error;
  }

  std::unique_ptr<Directory> Open(const std::string& prefix, DirectoryOptions o = FastOptions()) {
    auto d = Directory::open(etcd_.url(prefix), o);
    EXPECT_TRUE(d.ok()) << d.status().to_string();
    return d.ok() ? std::move(d.value()) : nullptr;
  }

  std::unique_ptr<Target> StartTarget(const std::string& prefix, const std::string& name) {
    std::string error;
    auto t = Target::Start(etcd_.url(prefix), name, &error);
    EXPECT_NE(t, nullptr) << error;
    return t;
  }

  // Looks the target up by name, writes `len` pattern bytes at `offset` of
  // its buffer and has the target check them in its own memory.
  void WriteAndVerify(Engine& engine, Directory& dir, Target& target, const std::string& name,
                      uint64_t seed, uint64_t offset, uint64_t len) {
    auto peer = connect_by_name(engine, dir, name, 5s);
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    auto desc = lookup_descriptor(dir, name, "buf", 5s);
    ASSERT_TRUE(desc.ok()) << desc.status().to_string();
    WriteWith(engine, peer.value(), desc.value(), target, seed, offset, len);
  }

  void WriteWith(Engine& engine, PeerId peer, const RemoteDescriptor& desc, Target& target,
                 uint64_t seed, uint64_t offset, uint64_t len) {
    itest::Buffer src(len);
    itest::FillPattern(seed, offset, src.data(), len);
    auto region = engine.register_memory(src.data(), len);
    ASSERT_TRUE(region.ok()) << region.status().to_string();
    // Many iovs, to move real scatter-gather traffic.
    constexpr uint64_t kBlock = 64 << 10;
    std::vector<LocalIov> local;
    std::vector<RemoteIov> remote;
    for (uint64_t at = 0; at < len; at += kBlock) {
      const uint64_t n = std::min(kBlock, len - at);
      local.push_back({src.data() + at, n});
      remote.push_back({&desc, offset + at, n});
    }
    Status s = engine.write(peer, local, remote, std::nullopt, 30s);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(target.Command("verify " + std::to_string(seed) + " " + std::to_string(offset) + " " +
                             std::to_string(len)),
              "OK");
    (void)engine.deregister_memory(region->id);
  }

  EtcdServer etcd_;
};

TEST(DirectoryNames, ValidatedBeforeAnyRequest) {
  for (std::string_view good : {"decode-3", "prefill_0", "a.b", "A", "x..y"}) {
    EXPECT_TRUE(validate_directory_name("engine name", good).ok()) << good;
  }
  const std::string long_name(129, 'a');
  for (std::string_view bad :
       {std::string_view(""), std::string_view("."), std::string_view(".."),
        std::string_view("a/b"), std::string_view("../x"), std::string_view("a b"),
        std::string_view("é"), std::string_view(long_name)}) {
    Status s = validate_directory_name("engine name", bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("engine name"), std::string::npos) << s.message();
  }
  EXPECT_TRUE(validate_directory_name("key", std::string(128, 'k')).ok());
}

TEST(DirectoryOpen, BadUrlsAreInvalidArguments) {
  for (const char* url :
       {"http://127.0.0.1:2379", "etcd://", "etcd://nohost/x", "etcd://127.0.0.1:2379/a/../b",
        "etcd://127.0.0.1:x/p", "etcd://127.0.0.1:2379/a b"}) {
    auto d = Directory::open(url);
    ASSERT_FALSE(d.ok()) << url;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << url;
    EXPECT_NE(d.status().message().find(url), std::string::npos) << d.status().message();
  }
}

TEST(DirectoryOpen, UnreachableStoreNamesTheEndpoint) {
  const int port = FreePort();  // nothing listens there
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  DirectoryOptions o;
  o.connect_timeout = 500ms;
  const auto start = Clock::now();
  auto d = Directory::open("etcd://" + endpoint + "/x", o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kPeerDisconnected) << d.status().to_string();
  EXPECT_NE(d.status().message().find(endpoint), std::string::npos) << d.status().message();
  EXPECT_LT(Seconds(Clock::now() - start), 5.0);
}

TEST_F(DirectoryTest, PublishLookupAndConnectAcrossProcesses) {
  auto target = StartTarget("job1", "decode-3");
  ASSERT_NE(target, nullptr);
  auto dir = Open("job1");
  ASSERT_NE(dir, nullptr);
  auto engine = Engine::create();
  ASSERT_TRUE(engine.ok());

  auto names = dir->engines();
  ASSERT_TRUE(names.ok()) << names.status().to_string();
  EXPECT_EQ(names.value(), std::vector<std::string>{"decode-3"});

  WriteAndVerify(*engine.value(), *dir, *target, "decode-3", 11, 0, 4 << 20);
  WriteAndVerify(*engine.value(), *dir, *target, "decode-3", 12, 5 << 20, 3 << 20);

  // The other way round: this process publishes, the target looks it up.
  ASSERT_TRUE(dir->publish_engine("prefill-0", engine.value()->metadata()).ok());
  EXPECT_EQ(target->Command("lookup prefill-0"),
            "OK " + std::to_string(engine.value()->metadata().size()));

  // Another prefix is another namespace.
  auto other = Open("job2");
  ASSERT_NE(other, nullptr);
  auto missing = other->lookup_engine("decode-3");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("decode-3"), std::string::npos);
  EXPECT_NE(missing.status().message().find(etcd_.client_address()), std::string::npos)
      << missing.status().message();

  // Keys: missing, waited for, and only under a held name.
  auto no_key = dir->lookup("decode-3", "nope");
  EXPECT_EQ(no_key.status().code(), StatusCode::kNotFound);
  EXPECT_NE(no_key.status().message().find("nope"), std::string::npos);
  const auto start = Clock::now();
  auto waited = dir->lookup("decode-3", "nope", 300ms);
  EXPECT_EQ(waited.status().code(), StatusCode::kTimeout) << waited.status().to_string();
  EXPECT_GE(Seconds(Clock::now() - start), 0.25);
  Status not_held = dir->publish("decode-3", "k", Bytes{1});
  EXPECT_EQ(not_held.code(), StatusCode::kInvalidArgument) << not_held.to_string();
  EXPECT_EQ(dir->publish("prefill-0", "../etc", Bytes{1}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(dir->publish("prefill-0", "k", Bytes{1, 2, 3}).ok());
  auto k = dir->lookup("prefill-0", "k");
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k.value(), (Bytes{1, 2, 3}));
  // A key that is not a descriptor is refused by lookup_descriptor.
  EXPECT_EQ(lookup_descriptor(*dir, "prefill-0", "k").status().code(),
            StatusCode::kInvalidArgument);

  // Waiting for an engine that appears later.
  std::thread later([&] {
    std::this_thread::sleep_for(400ms);
    auto d2 = Open("job1");
    auto e2 = Engine::create();
    if (d2 && e2.ok()) {
      EXPECT_TRUE(d2->publish_engine("late", e2.value()->metadata()).ok());
      std::this_thread::sleep_for(1s);
    }
  });
  auto late = dir->lookup_engine("late", 10s);
  later.join();
  EXPECT_TRUE(late.ok()) << late.status().to_string();

  // unpublish_engine deletes the name and its keys; a clean exit revokes the lease.
  ASSERT_TRUE(dir->unpublish_engine("prefill-0").ok());
  EXPECT_EQ(dir->lookup("prefill-0", "k").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(target->Command("exit"), "BYE");
  EXPECT_EQ(dir->lookup_engine("decode-3").status().code(), StatusCode::kNotFound);
}

TEST_F(DirectoryTest, EntriesVanishWithinTheLeaseTtlAfterSigkill) {
  auto target = StartTarget("job", "victim");
  ASSERT_NE(target, nullptr);
  auto dir = Open("job");
  ASSERT_NE(dir, nullptr);
  auto engine = Engine::create();
  ASSERT_TRUE(engine.ok());
  WriteAndVerify(*engine.value(), *dir, *target, "victim", 3, 0, 1 << 20);
  // Past one full ttl: the keep-alive, not the first grant, holds it.
  std::this_thread::sleep_for(std::chrono::seconds(kTtl) + 500ms);
  ASSERT_TRUE(dir->lookup_engine("victim").ok());

  target->child->Kill(SIGKILL);
  ASSERT_TRUE(target->child->Wait(5s).has_value());
  const auto killed = Clock::now();
  bool gone = Eventually(std::chrono::seconds(kTtl) + 4s, [&] {
    return dir->lookup_engine("victim").status().code() == StatusCode::kNotFound;
  });
  const double after = Seconds(Clock::now() - killed);
  ASSERT_TRUE(gone) << "still there " << after << " s after SIGKILL";
  std::printf("[ entries gone %.2f s after SIGKILL, lease ttl %d s ]\n", after, kTtl);
  EXPECT_EQ(dir->lookup("victim", "buf").status().code(), StatusCode::kNotFound);
  auto names = dir->engines();
  ASSERT_TRUE(names.ok());
  EXPECT_TRUE(names->empty());

  // A restarted engine publishes fresh metadata under the old name.
  auto again = StartTarget("job", "victim");
  ASSERT_NE(again, nullptr);
  WriteAndVerify(*engine.value(), *dir, *again, "victim", 4, 1 << 20, 1 << 20);
}

TEST_F(DirectoryTest, ASecondEngineClaimingANameIsRefused) {
  auto target = StartTarget("job", "decode-0");
  ASSERT_NE(target, nullptr);
  auto dir = Open("job");
  ASSERT_NE(dir, nullptr);
  auto engine = Engine::create();
  ASSERT_TRUE(engine.ok());
  auto before = dir->lookup_engine("decode-0");
  ASSERT_TRUE(before.ok());

  Status s = dir->publish_engine("decode-0", engine.value()->metadata());
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  EXPECT_NE(s.message().find("decode-0"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("pid " + std::to_string(target->pid)), std::string::npos)
      << s.message();
  // Not overwritten: the holder's metadata is still what is published.
  auto after = dir->lookup_engine("decode-0");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after.value(), before.value());
  WriteAndVerify(*engine.value(), *dir, *target, "decode-0", 8, 0, 1 << 20);

  // Republishing one's own name replaces the metadata.
  ASSERT_TRUE(dir->publish_engine("mine", Bytes{1}).ok());
  ASSERT_TRUE(dir->publish_engine("mine", Bytes{2}).ok());
  EXPECT_EQ(dir->lookup_engine("mine").value(), Bytes{2});

  // Once the holder is killed, a claimer that waits takes the name.
  target->child->Kill(SIGKILL);
  ASSERT_TRUE(target->child->Wait(5s).has_value());
  DirectoryOptions waiting = FastOptions();
  waiting.claim_wait = std::chrono::seconds(kTtl) + 4s;
  auto dir2 = Open("job", waiting);
  ASSERT_NE(dir2, nullptr);
  const auto start = Clock::now();
  Status taken = dir2->publish_engine("decode-0", engine.value()->metadata());
  EXPECT_TRUE(taken.ok()) << taken.to_string();
  std::printf("[ name taken over %.2f s after the holder's SIGKILL ]\n",
              Seconds(Clock::now() - start));
  EXPECT_EQ(dir->lookup_engine("decode-0").value(), engine.value()->metadata());
}

TEST_F(DirectoryTest, EtcdKilledAndRestartedMidRun) {
  auto target = StartTarget("job", "decode-1");
  ASSERT_NE(target, nullptr);
  auto dir = Open("job");
  ASSERT_NE(dir, nullptr);
  auto engine = Engine::create();
  ASSERT_TRUE(engine.ok());
  ASSERT_TRUE(dir->publish_engine("prefill-1", engine.value()->metadata()).ok());
  ASSERT_TRUE(dir->publish("prefill-1", "k", Bytes{7}).ok());
  auto peer = connect_by_name(*engine.value(), *dir, "decode-1", 5s);
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  auto desc = lookup_descriptor(*dir, "decode-1", "buf", 5s);
  ASSERT_TRUE(desc.ok());
  WriteWith(*engine.value(), peer.value(), desc.value(), *target, 21, 0, 1 << 20);

  // 1. etcd dies: connected peers keep working, lookups fail naming the
  // endpoint, publishing fails, health() says why.
  etcd_.Kill();
  WriteWith(*engine.value(), peer.value(), desc.value(), *target, 22, 1 << 20, 2 << 20);
  auto down = dir->lookup_engine("decode-1");
  ASSERT_FALSE(down.ok());
  EXPECT_EQ(down.status().code(), StatusCode::kPeerDisconnected) << down.status().to_string();
  EXPECT_NE(down.status().message().find(etcd_.client_address()), std::string::npos)
      << down.status().message();
  EXPECT_NE(down.status().message().find("decode-1"), std::string::npos) << down.status().message();
  Status pub = dir->publish("prefill-1", "k2", Bytes{8});
  EXPECT_EQ(pub.code(), StatusCode::kPeerDisconnected) << pub.to_string();
  ASSERT_TRUE(Eventually(std::chrono::seconds(kTtl) + 2s, [&] { return !dir->health().ok(); }));
  EXPECT_NE(dir->health().message().find(etcd_.client_address()), std::string::npos)
      << dir->health().to_string();
  // Down for longer than the ttl.
  std::this_thread::sleep_for(std::chrono::seconds(kTtl) + 500ms);
  WriteWith(*engine.value(), peer.value(), desc.value(), *target, 23, 3 << 20, 1 << 20);

  // 2. etcd back with its data: leases survive, keep-alives resume.
  std::string error;
  ASSERT_TRUE(etcd_.Start(&error)) << error;
  auto start = Clock::now();
  ASSERT_TRUE(Eventually(10s, [&] { return dir->health().ok(); })) << dir->health().to_string();
  std::printf("[ healthy again %.2f s after etcd restarted ]\n", Seconds(Clock::now() - start));
  EXPECT_TRUE(dir->lookup("prefill-1", "k").ok());
  EXPECT_TRUE(dir->lookup_engine("decode-1").ok());
  // The target is another process with its own keep-alive schedule: a request
  // it sent while etcd was starting may still run out its timeout.
  EXPECT_TRUE(Eventually(10s, [&] { return target->Command("health") == "OK"; }))
      << target->Command("health");
  ASSERT_TRUE(dir->publish("prefill-1", "k2", Bytes{8}).ok());

  // 3. etcd back empty (data lost): the lease is granted anew and every
  // entry put back, by this process and by the target.
  const int64_t old_lease = dir->lease_id();
  etcd_.Kill();
  etcd_.WipeData();
  ASSERT_TRUE(etcd_.Start(&error)) << error;
  start = Clock::now();
  ASSERT_TRUE(Eventually(std::chrono::seconds(kTtl) + 8s, [&] {
    return dir->lookup("prefill-1", "k2").ok() && dir->lookup_engine("decode-1").ok() &&
           dir->lookup("decode-1", "buf").ok();
  }));
  std::printf("[ every entry republished %.2f s after etcd restarted empty ]\n",
              Seconds(Clock::now() - start));
  EXPECT_NE(dir->lease_id(), old_lease);
  EXPECT_EQ(dir->lookup("prefill-1", "k").value(), Bytes{7});
  EXPECT_TRUE(dir->health().ok()) << dir->health().to_string();
  // The republished entries are live again: a fresh lookup moves data.
  auto fresh = Engine::create();
  ASSERT_TRUE(fresh.ok());
  WriteAndVerify(*fresh.value(), *dir, *target, "decode-1", 24, 4 << 20, 1 << 20);
  // And they are under a lease again: the target's vanish when it is killed.
  target->child->Kill(SIGKILL);
  ASSERT_TRUE(Eventually(std::chrono::seconds(kTtl) + 4s, [&] {
    return dir->lookup_engine("decode-1").status().code() == StatusCode::kNotFound;
  }));
}

}  // namespace
}  // namespace ferry::dtest

namespace ferry::dtest {
namespace {

// The engine's own directory settings (EngineConfig::directory and name):
// connect by name, descriptors by key, a taken name refused at create(), and
// the entries gone with the engine.
TEST_F(DirectoryTest, EngineConfigPublishesConnectsAndLooksUpByName) {
  EngineConfig pc;
  pc.directory = etcd_.url("cfg");
  pc.name = "prefill-0";
  auto prefill = Engine::create(pc);
  ASSERT_TRUE(prefill.ok()) << prefill.status().to_string();
  EXPECT_EQ((*prefill)->name(), "prefill-0");
  itest::Buffer kv(1 << 20);
  auto region = (*prefill)->register_memory(kv.data(), kv.size());
  ASSERT_TRUE(region.ok()) << region.status().to_string();
  auto desc = (*prefill)->advertise(region->id);
  ASSERT_TRUE(desc.ok());
  ASSERT_TRUE((*prefill)->publish("layer-12", *desc).ok());

  EngineConfig same = pc;  // a live engine holds the name
  auto twin = Engine::create(same);
  ASSERT_FALSE(twin.ok());
  EXPECT_EQ(twin.status().code(), StatusCode::kPermissionDenied) << twin.status().to_string();

  EngineConfig dc;
  dc.directory = etcd_.url("cfg");
  dc.name = "decode-3";
  auto decode = Engine::create(dc);
  ASSERT_TRUE(decode.ok()) << decode.status().to_string();
  auto peer = (*decode)->connect("prefill-0", 5s);
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  EXPECT_EQ(*peer, (*prefill)->id());
  auto remote = (*decode)->lookup("prefill-0", "layer-12", 5s);
  ASSERT_TRUE(remote.ok()) << remote.status().to_string();
  itest::Buffer src(256 << 10);
  itest::FillPattern(77, 0, src.data(), src.size());
  auto local = (*decode)->register_memory(src.data(), src.size());
  ASSERT_TRUE(local.ok());
  LocalIov l{src.data(), src.size()};
  RemoteIov r{&*remote, 4096, src.size()};
  ASSERT_TRUE((*decode)->write(*peer, {&l, 1}, {&r, 1}).ok());
  EXPECT_TRUE(itest::MatchesPattern(77, 0, kv.data() + 4096, src.size()));

  auto missing = (*decode)->lookup("prefill-0", "layer-13");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().to_string();
  EXPECT_EQ((*decode)->connect("prefill-9").status().code(), StatusCode::kNotFound);
  // Another engine's descriptor is not ours to publish.
  EXPECT_EQ((*decode)->publish("stolen", *desc).code(), StatusCode::kInvalidArgument);

  prefill->reset();  // its lease is revoked with it
  EXPECT_EQ((*decode)->lookup("prefill-0", "layer-12").status().code(), StatusCode::kNotFound);
  auto again = Engine::create(pc);  // and the name is free again
  EXPECT_TRUE(again.ok()) << again.status().to_string();
}

TEST(DirectoryConfig, NameAndDirectoryGoTogether) {
  EngineConfig c;
  c.name = "decode-1";
  auto e = Engine::create(c);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("directory"), std::string::npos) << e.status().to_string();
  EngineConfig plain;
  auto p = Engine::create(plain);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->lookup("x", "y").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::dtest
