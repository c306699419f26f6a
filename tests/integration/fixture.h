// GoogleTest helpers shared by the integration suites.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <thread>

#include "ferry/engine.h"
#include "test_util.h"

namespace ferry::itest {

inline std::unique_ptr<Engine> MakeEngine(std::map<std::string, std::string> options = {},
                                          std::string listen = "127.0.0.1:0") {
  EngineConfig c;
  c.listen = std::move(listen);
  c.options = std::move(options);
  auto e = Engine::create(c);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(e.value()) : nullptr;
}

inline std::unique_ptr<TestPeer> StartPeer(PeerOptions o) {
  std::string error;
  auto p = TestPeer::Start(o, &error);
  EXPECT_NE(p, nullptr) << error;
  return p;
}

// Local memory registered with an engine, deregistered on destruction.
class LocalBuffer {
 public:
  LocalBuffer(Engine& e, size_t size) : engine_(e), buf_(size) {
    auto r = e.register_memory(buf_.data(), size);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (r.ok()) region_ = r->id;
  }
  ~LocalBuffer() {
    if (region_) (void)engine_.deregister_memory(region_);
  }
  uint8_t* data() const { return buf_.data(); }
  size_t size() const { return buf_.size(); }
  RegionId region() const { return region_; }

 private:
  Engine& engine_;
  Buffer buf_;
  RegionId region_ = 0;
};

// SIGSTOP, then waits until the kernel shows the process stopped ('T' in
// /proc/PID/stat): kill() returns before a running target has stopped, and
// it may answer a frame or two meanwhile.
inline void Stop(TestPeer& peer) {
  peer.process().Kill(SIGSTOP);
  const std::string path = "/proc/" + std::to_string(peer.process().pid()) + "/stat";
  for (int i = 0; i < 2000; ++i) {
    std::ifstream in(path);
    std::string stat;
    std::getline(in, stat);
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'T') return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ADD_FAILURE() << "peer " << peer.process().pid() << " did not stop";
}

// True if `text` contains `prefix`, then at most `max_gap` non-digits, then
// the decimal `n` not followed by another digit ("region 7", "region=7").
inline bool MentionsAfter(const std::string& text, std::string_view prefix, size_t max_gap,
                          uint64_t n) {
  const std::string num = std::to_string(n);
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  for (size_t at = text.find(prefix); at != std::string::npos; at = text.find(prefix, at + 1)) {
    size_t p = at + prefix.size();
    for (size_t gap = 0; gap <= max_gap && p <= text.size(); ++gap, ++p) {
      if (text.compare(p, num.size(), num) == 0 &&
          (p + num.size() == text.size() || !digit(text[p + num.size()]))) {
        return true;
      }
      if (p == text.size() || digit(text[p])) break;
    }
  }
  return false;
}

// True if `text` contains the decimal `n` as a whole number.
inline bool MentionsNumber(const std::string& text, uint64_t n) {
  const std::string num = std::to_string(n);
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  for (size_t at = text.find(num); at != std::string::npos; at = text.find(num, at + 1)) {
    const bool left = at == 0 || !digit(text[at - 1]);
    const bool right = at + num.size() == text.size() || !digit(text[at + num.size()]);
    if (left && right) return true;
  }
  return false;
}

// The message names region `id` ("region 7", "region=7", ...).
inline ::testing::AssertionResult NamesRegion(const Status& s, RegionId id) {
  if (MentionsAfter(s.message(), "region", 3, id)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "message does not name region " << id << ": " << s.to_string();
}

inline ::testing::AssertionResult NamesNumber(const Status& s, uint64_t n) {
  char hex[32];
  snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(n));
  if (MentionsNumber(s.message(), n) || s.message().find(hex) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "message does not name " << n << ": " << s.to_string();
}

// Waits for an async transfer by polling test() (the other completion path).
inline Status PollUntilDone(Engine& e, TransferId id, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    Status s = e.test(id);
    if (s.code() != StatusCode::kInProgress) return s;
    if (std::chrono::steady_clock::now() > deadline) return s;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

inline std::string Describe(const Status& s) {
  return s.to_string();
}

}  // namespace ferry::itest
