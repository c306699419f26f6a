// A peer that stops (SIGSTOP) owing the answer to a read, and resumes after
// the read has ended. Whatever ended it -- the transport's verdict on the
// peer or the caller's cancel() -- the caller may reuse the buffer from then
// on, so nothing may write it after that, not even the answer the resumed
// peer still sends. Run over tcp, shm (both modes) and fabric (CMakeLists).
//
// fabric declares a peer it has not heard from for fabric.peer_timeout_ms
// (500 ms here) dead while the provider still holds the read: the transfer
// may end only once the provider gave the read back, which a stopped peer
// makes it do when it resumes.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "fixture.h"

namespace ferry::itest {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kMiB = 1 << 20;
constexpr size_t kIovs = 32;
constexpr uint64_t kIovBytes = kMiB;
constexpr uint8_t kUntouched = 0x5a;

std::string Forced() {
  const char* t = std::getenv("FERRY_ENGINE_TRANSPORTS");
  return t != nullptr ? t : "";
}

// The first byte where a and b differ, or -1.
int64_t FirstDifference(const uint8_t* a, const uint8_t* b, size_t n) {
  if (std::memcmp(a, b, n) == 0) return -1;
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

TEST(StoppedPeer, AReadThatEndedIsNeverWrittenWhenThePeerResumes) {
  const bool fabric = Forced().rfind("fabric", 0) == 0;
  if (fabric) {
    setenv("FERRY_FABRIC_PEER_TIMEOUT_MS", "500", 1);
    setenv("FERRY_FABRIC_CANCEL_TIMEOUT_MS", "20000", 1);
  }
  PeerOptions o;
  o.size = kIovs * kIovBytes;
  auto peer = StartPeer(o);
  ASSERT_TRUE(peer);
  auto e = MakeEngine();
  ASSERT_TRUE(e);
  auto p = e->connect(ByteView(peer->metadata));
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  LocalBuffer local(*e, kIovs * kIovBytes);
  std::vector<LocalIov> li;
  std::vector<RemoteIov> ri;
  for (size_t i = 0; i < kIovs; ++i) {
    li.push_back({local.data() + i * kIovBytes, kIovBytes});
    ri.push_back({&peer->rw, i * kIovBytes, kIovBytes});
  }
  // A first read while the peer runs (fabric fetches the descriptor's key
  // from its target once), checked against the peer's own hash.
  ASSERT_TRUE(e->read(*p, li, ri, 20s).ok());
  auto sum = peer->Checksum(0, local.size());
  ASSERT_TRUE(sum);
  ASSERT_EQ(*sum, HashBytes(local.data(), local.size()));

  std::memset(local.data(), kUntouched, local.size());
  Stop(*peer);
  auto id = e->read_async(*p, li, ri);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  // Long enough for fabric to declare the peer dead.
  std::this_thread::sleep_for(1500ms);
  const std::vector<uint8_t> untouched(local.size(), kUntouched);
  const int64_t early_write = FirstDifference(untouched.data(), local.data(), local.size());
  ASSERT_EQ(early_write, -1) << "byte " << early_write << " written while the peer was stopped";

  // The peer resumes a second from now. Unless the read has ended already,
  // cancel() meanwhile (fabric's waits for the provider, the others' return
  // at once).
  std::thread resume([&] {
    std::this_thread::sleep_for(1000ms);
    peer->process().Kill(SIGCONT);
  });
  Status ended = e->test(*id);
  std::printf("after 1.5 s stopped: %s\n", ended.to_string().c_str());
  if (ended.code() == StatusCode::kInProgress) {
    const auto t0 = Clock::now();
    EXPECT_TRUE(e->cancel(*id).ok());
    const long cancel_ms = static_cast<long>(
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
    ended = e->test(*id);
    std::printf("cancel() returned after %ld ms; the read: %s\n", cancel_ms,
                ended.to_string().c_str());
  }
  EXPECT_NE(ended.code(), StatusCode::kInProgress) << "the read has not ended after cancel()";
  EXPECT_FALSE(ended.ok()) << "the read completed although the peer was stopped";
  // From here on the buffer is the caller's again.
  std::vector<uint8_t> at_end(local.data(), local.data() + local.size());
  resume.join();
  // The resumed peer answers what it owed; none of it may land.
  std::this_thread::sleep_for(1000ms);
  const int64_t diff = FirstDifference(at_end.data(), local.data(), local.size());
  EXPECT_EQ(diff, -1) << "byte " << diff << " of the read's buffer changed after the read ended ("
                      << ended.to_string() << "): was " << int{at_end[static_cast<size_t>(diff)]}
                      << ", now " << int{local.data()[diff]};
  EXPECT_TRUE(peer->Alive());
}

}  // namespace
}  // namespace ferry::itest
