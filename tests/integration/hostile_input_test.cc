// Hostile input is cheap for the target (docs/reliability.md, "Hostile
// input"): connections from parties nobody authenticated -- garbage,
// refused handshakes, handshakes never finished, handshakes under ever new
// engine ids -- cost the target process a bounded number of log lines,
// descriptors and bytes of memory.
//
// The target is a ferry_test_peer whose log (stderr) goes to a file that the
// test reads; its descriptors and memory are read from /proc.
#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <regex>
#include <sstream>

#include "core/metadata.h"
#include "fixture.h"
#include "raw_conn.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;
using namespace ferry::tcp;

// Under AddressSanitizer freed memory stays resident in its quarantine (256
// MB by default), so the RSS bounds are checked only in plain builds.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRssMeasurable = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kRssMeasurable = false;
#else
constexpr bool kRssMeasurable = true;
#endif
#else
constexpr bool kRssMeasurable = true;
#endif

// What the target allows for a handshake (tcp.connect_timeout_ms) here.
constexpr auto kHandshakeDeadline = 1000ms;
// The tcp transport's limiter: lines written one by one per window.
constexpr int kBurst = 5;
constexpr auto kWindow = 10s;

size_t OpenDescriptors(pid_t pid) {
  size_t n = 0;
  if (DIR* d = opendir(("/proc/" + std::to_string(pid) + "/fd").c_str())) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

uint64_t ResidentKiB(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6));
  }
  return 0;
}

std::vector<std::string> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

class HostileInput : public ::testing::Test {
 protected:
  void SetUp() override {
    char path[] = "/tmp/ferry-hostile-log-XXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    ::close(fd);
    log_path_ = path;
    // The peer's log (spdlog writes to its stderr) goes to the file.
    peer_ = StartPeer(
        {.size = 1 << 16,
         .seed = 9,
         .engine_options = {"tcp.connect_timeout_ms=" + std::to_string(kHandshakeDeadline.count())},
         .wrapper = {"/bin/sh", "-c", "exec \"$0\" \"$@\" 2>" + log_path_}});
    ASSERT_TRUE(peer_);
    pid_ = peer_->process().pid();
  }
  void TearDown() override {
    if (!HasFailure())
      ::unlink(log_path_.c_str());
    else
      fprintf(stderr, "the target's log is kept in %s\n", log_path_.c_str());
  }

  // Warnings the target wrote about tcp connections so far.
  std::vector<std::string> TcpWarnings() {
    std::vector<std::string> out;
    for (auto& line : ReadLines(log_path_)) {
      if (line.find("[warning]") != std::string::npos &&
          line.find("ferry tcp") != std::string::npos) {
        out.push_back(line);
      }
    }
    return out;
  }
  // Lines logged one by one and lines counted in summaries ("N more since").
  std::pair<uint64_t, uint64_t> Accounted(const std::vector<std::string>& warnings) {
    static const std::regex more(R"(: (\d+) more since )");
    uint64_t single = 0, summarized = 0;
    for (const auto& w : warnings) {
      std::smatch m;
      if (std::regex_search(w, m, more)) {
        summarized += std::stoull(m[1]);
      } else {
        ++single;
      }
    }
    return {single, summarized};
  }
  // The peer exits (its engine is destroyed: the limiter writes what it held).
  void StopPeer() {
    ASSERT_EQ(peer_->Command("exit"), "BYE");
    ASSERT_TRUE(peer_->process().Wait(10s).has_value()) << "the target did not exit";
  }
  // Waits until the target's descriptors are back to `baseline` (+slack).
  size_t SettledDescriptors(size_t baseline, size_t slack) {
    const auto deadline = Clock::now() + 5s;
    size_t n = OpenDescriptors(pid_);
    while (n > baseline + slack && Clock::now() < deadline) {
      std::this_thread::sleep_for(20ms);
      n = OpenDescriptors(pid_);
    }
    return n;
  }

  std::string log_path_;
  std::unique_ptr<TestPeer> peer_;
  pid_t pid_ = -1;
};

// 500 connections of five kinds, every one of them closed by the target; the
// target writes at most kBurst warnings per window plus one summary, and the
// summaries count every warning held back.
TEST_F(HostileInput, GarbageConnectionsCostBoundedLogLinesDescriptorsAndMemory) {
  ASSERT_TRUE(peer_->Alive());
  const size_t fds_before = OpenDescriptors(pid_);
  const uint64_t rss_before = ResidentKiB(pid_);
  std::mt19937_64 rng(29);
  uint64_t warnings_expected = 0;
  const auto t0 = Clock::now();
  constexpr int kConnections = 500;
  for (int i = 0; i < kConnections; ++i) {
    RawConn c(peer_->listen);
    ASSERT_TRUE(c.ok()) << "connection " << i << " refused: the target stopped accepting";
    Hello h = MakeHello(0x5000 + static_cast<uint64_t>(i));
    switch (i % 5) {
      case 0: {  // random bytes, at least a Hello's worth: "not a Ferry handshake"
        Bytes junk(sizeof(Hello) + rng() % 200);
        for (auto& b : junk) b = static_cast<uint8_t>(rng());
        c.Send(junk);
        warnings_expected += 1;
        break;
      }
      case 1:  // another protocol version: refused with a reply
        h.protocol_version = static_cast<uint16_t>(kProtocolVersion + 1 + rng() % 100);
        c.Send(&h, sizeof h);
        warnings_expected += 1;
        break;
      case 2:  // a malformed handshake: refused
        h.stream_count = 0;
        c.Send(&h, sizeof h);
        warnings_expected += 1;
        break;
      case 3: {  // a valid handshake, then a frame header of garbage
        c.Send(&h, sizeof h);
        HelloReply reply{};
        ASSERT_TRUE(c.RecvExact(&reply, sizeof reply, 10s)) << "connection " << i;
        ASSERT_EQ(reply.status, 0);
        Bytes junk(sizeof(FrameHeader));
        for (auto& b : junk) b = static_cast<uint8_t>(rng());
        c.Send(junk);
        warnings_expected += 2;  // the bad frame; the connection lost
        break;
      }
      case 4:  // part of a Hello, then closed by us (an info line: not shown)
        c.Send(&h, 1 + rng() % (sizeof h - 1));
        c.Close();
        continue;
    }
    ASSERT_TRUE(c.ClosedByPeer(10s))
        << "connection " << i << " (kind " << i % 5 << ") was left open";
  }
  const auto elapsed = Clock::now() - t0;
  ASSERT_TRUE(peer_->Alive()) << "the target stopped answering";

  // Descriptors: every connection's socket is closed again.
  const size_t fds_after = SettledDescriptors(fds_before, 2);
  EXPECT_LE(fds_after, fds_before + 2)
      << "the target holds " << fds_after - fds_before << " more descriptors after " << kConnections
      << " hostile connections than before";
  // Memory: no per-connection growth worth the name (8 MiB would be 16 KiB each).
  const uint64_t rss_after = ResidentKiB(pid_);
  if (kRssMeasurable) {
    EXPECT_LT(rss_after, rss_before + 8 * 1024)
        << "the target's RSS grew from " << rss_before << " KiB to " << rss_after << " KiB";
  }

  // Log lines while it runs: kBurst per window (started) at most, a summary each.
  const auto windows = static_cast<uint64_t>(elapsed / kWindow) + 1;
  const auto during = TcpWarnings();
  EXPECT_LE(during.size(), windows * (kBurst + 1))
      << kConnections << " hostile connections in "
      << std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count() << " ms wrote "
      << during.size() << " warnings; the first: " << (during.empty() ? "" : during.front());
  EXPECT_GE(during.size(), 1u) << "no warning at all about hostile connections";

  // At exit the limiter writes what it held back: every warning is accounted for.
  StopPeer();
  const auto all = TcpWarnings();
  const auto [single, summarized] = Accounted(all);
  EXPECT_LE(all.size(), windows * (kBurst + 1) + 1);
  EXPECT_EQ(single + summarized, warnings_expected)
      << single << " warnings written one by one, " << summarized
      << " counted in summaries; the last line: " << (all.empty() ? "" : all.back());
  EXPECT_GT(summarized, 0u) << "no summary line (\"N more since ...\") at exit";
}

// Connections that never finish their handshake (nothing sent, or part of a
// Hello) are closed once tcp.connect_timeout_ms has passed, not before; their
// descriptors come back and the warnings stay bounded.
TEST_F(HostileInput, HalfOpenConnectionsAreClosedAfterTheHandshakeDeadline) {
  ASSERT_TRUE(peer_->Alive());
  const size_t fds_before = OpenDescriptors(pid_);
  constexpr int kHalfOpen = 200;
  std::vector<std::unique_ptr<RawConn>> conns;
  const Hello h = MakeHello(0x6000);
  const auto t0 = Clock::now();
  for (int i = 0; i < kHalfOpen; ++i) {
    conns.push_back(std::make_unique<RawConn>(peer_->listen));
    ASSERT_TRUE(conns.back()->ok()) << "connection " << i;
    if (i % 2 == 1) {
      ASSERT_TRUE(conns.back()->Send(&h, static_cast<size_t>(i) % sizeof h));
    }
  }
  // The target holds them while the deadline runs (the check is not vacuous).
  // Its I/O thread accepts them at its own pace (slowly on a loaded machine),
  // and each is held for a whole deadline from its accept, so the peak count
  // within one deadline of the first connect is what shows it.
  size_t fds_holding = OpenDescriptors(pid_);
  while (fds_holding < fds_before + kHalfOpen / 2 && Clock::now() - t0 < kHandshakeDeadline) {
    std::this_thread::sleep_for(5ms);
    fds_holding = std::max(fds_holding, OpenDescriptors(pid_));
  }
  EXPECT_GE(fds_holding, fds_before + kHalfOpen / 2)
      << "the target never held more than " << fds_holding - fds_before << " of " << kHalfOpen
      << " half-open connections at once";
  EXPECT_TRUE(peer_->Alive()) << "half-open connections blocked the target";
  for (int i = 0; i < kHalfOpen; ++i) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        t0 + kHandshakeDeadline + 4s - Clock::now());
    ASSERT_TRUE(conns[static_cast<size_t>(i)]->ClosedByPeer(std::max(left, 1ms)))
        << "half-open connection " << i << " still open " << kHandshakeDeadline.count() + 4000
        << " ms after it connected";
  }
  EXPECT_GE(Clock::now() - t0, kHandshakeDeadline / 2) << "closed before the deadline";
  const size_t fds_after = SettledDescriptors(fds_before, 2);
  EXPECT_LE(fds_after, fds_before + 2);
  const auto elapsed = Clock::now() - t0;
  const auto windows = static_cast<uint64_t>(elapsed / kWindow) + 1;
  const auto during = TcpWarnings();
  EXPECT_LE(during.size(), windows * (kBurst + 1))
      << kHalfOpen << " half-open connections wrote " << during.size() << " warnings";
  StopPeer();
  const auto [single, summarized] = Accounted(TcpWarnings());
  EXPECT_EQ(single + summarized, static_cast<uint64_t>(kHalfOpen))
      << "every expired handshake is logged or counted once";
}

// Handshakes under ever new engine ids: what the target keeps about peers
// that went away is bounded (the oldest are forgotten past 1,024), so the
// ids of the first are unknown again and the latest are still known.
TEST_F(HostileInput, PeersThatWentAwayAreForgottenPastABound) {
  constexpr uint64_t kPeers = 1024 + 200;
  const uint64_t base = 0x7000'0000ull;
  for (uint64_t i = 0; i < kPeers; ++i) {
    RawConn c(peer_->listen);
    ASSERT_TRUE(c.ok()) << "connection " << i;
    Hello h = MakeHello(base + i);
    ASSERT_TRUE(c.Send(&h, sizeof h));
    HelloReply reply{};
    ASSERT_TRUE(c.RecvExact(&reply, sizeof reply, 10s)) << "connection " << i;
    ASSERT_EQ(reply.status, 0) << "connection " << i;
  }  // each closed by us: the target sees the peer go away
  auto carriers = [&](uint64_t id) { return peer_->Command("carriers " + Hex64(id)); };
  // The last peer's departure is processed (it is known, and down).
  const auto deadline = Clock::now() + 10s;
  std::string last = carriers(base + kPeers - 1);
  while (last.find("tcp=down") == std::string::npos && Clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
    last = carriers(base + kPeers - 1);
  }
  EXPECT_NE(last.find("tcp=down"), std::string::npos) << "the last peer: " << last;
  for (uint64_t i = 0; i < 20; ++i) {
    const std::string first = carriers(base + i);
    EXPECT_EQ(first.rfind("ERR NotFound", 0), 0u)
        << "peer " << i << " of " << kPeers << " that went away is still kept: " << first;
  }
  for (uint64_t i = kPeers - 100; i < kPeers; ++i) {
    const std::string recent = carriers(base + i);
    EXPECT_EQ(recent.rfind("OK", 0), 0u) << "recent peer " << i << " was forgotten: " << recent;
  }
  ASSERT_TRUE(peer_->Alive());
}

// Handshakes of revision 2 under ever new engine ids, each with ~60 KiB of
// metadata, for a group of two streams whose second never comes (so no peer
// ever comes up or goes away): what the target keeps of such metadata is
// bounded (256 entries), so its memory does not grow by the ~90 MB sent.
TEST_F(HostileInput, HandshakeMetadataUnderNewIdsCostsBoundedMemory) {
  ASSERT_TRUE(peer_->Alive());
  const uint64_t rss_before = ResidentKiB(pid_);
  constexpr uint64_t kHandshakes = 1500;
  const uint64_t base = 0x8000'0000ull;
  for (uint64_t i = 0; i < kHandshakes; ++i) {
    EngineMetadata m;
    m.engine_id = base + i;
    m.protocol_version = kProtocolVersion;
    m.hostname = "hostile";
    m.host_id = "not-this-host";
    for (int t = 0; t < 16; ++t) {
      m.transports.push_back({"t" + std::to_string(t), Bytes(3700, static_cast<uint8_t>(i))});
    }
    const Bytes ours = m.encode();
    ASSERT_GT(ours.size(), 56u * 1024);
    RawConn c(peer_->listen);
    ASSERT_TRUE(c.ok()) << "connection " << i;
    Hello h = MakeHello(base + i);
    h.stream_count = 2;
    h.handshake_revision = kHandshakeRevisionMetadata;
    h.metadata_bytes = static_cast<uint32_t>(ours.size());
    ASSERT_TRUE(c.Send(&h, sizeof h));
    HelloReply reply{};
    ASSERT_TRUE(c.RecvExact(&reply, sizeof reply, 10s)) << "connection " << i;
    ASSERT_EQ(reply.status, 0) << "connection " << i;
    ASSERT_EQ(reply.handshake_revision, kHandshakeRevisionMetadata);
    Bytes theirs(reply.message_bytes);
    ASSERT_TRUE(c.RecvExact(theirs.data(), theirs.size(), 10s));
    ASSERT_TRUE(c.Send(ours));
    ASSERT_TRUE(c.RecvExact(&reply, sizeof reply, 10s)) << "connection " << i;
    ASSERT_EQ(reply.status, 0) << "the target refused the metadata of connection " << i;
  }  // each closed by us, its group incomplete
  ASSERT_TRUE(peer_->Alive());
  const uint64_t rss_after = ResidentKiB(pid_);
  if (kRssMeasurable) {
    EXPECT_LT(rss_after, rss_before + 32 * 1024)
        << "the target's RSS grew from " << rss_before << " KiB to " << rss_after << " KiB after "
        << kHandshakes << " handshakes with ~60 KiB of metadata each";
  }
}

}  // namespace
}  // namespace ferry::itest
