// Shared by the fuzz targets that drive a real engine over loopback tcp
// (fuzz_tcp_frames, fuzz_tcp_handshake): what keeps a run's cost that of its
// connections.
#pragma once

#include <sanitizer/allocator_interface.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ferry::fuzz {

// Whether the region is still all zeros: one memcmp, not a loop over its
// bytes, where libFuzzer would trace every comparison and UBSan check every
// pointer step -- tens of thousands of calls a run, more than its connection.
inline bool untouched(const std::vector<uint8_t>& memory) {
  static std::vector<uint8_t> zeros;
  if (zeros.size() < memory.size()) zeros.assign(memory.size(), 0);
  return std::memcmp(memory.data(), zeros.data(), memory.size()) == 0;
}

// libFuzzer counts the mallocs and frees of every thread while a run lasts;
// more mallocs than frees and it runs the input again and then scans the
// whole heap for leaks (LeakSanitizer), up to 1000 times in a process. The
// engine finishes a connection that closed -- its log line, the peer's
// loss, the stream freed after the I/O thread's batch -- on its own thread,
// after the socket has already shown us EOF: a run that returned at once
// left those frees to the next run, and one run in three looked like a leak
// (twice the work and a heap scan each). A run waits for them instead:
// construct an EngineSettle first, let every object the run allocated go,
// then wait() -- microseconds as a rule. What the engine keeps (a real leak,
// or state that grew: a longer log line held back, a new queue block) shows
// once its thread has gone quiet, and libFuzzer checks it as before.
class EngineSettle {
 public:
  EngineSettle() {
    static const bool installed = __sanitizer_install_malloc_and_free_hooks(on_malloc, on_free);
    (void)installed;
    mallocs_ = count(mallocs());
    frees_ = count(frees());
  }

  // Whether every malloc since construction has been freed. Waits while the
  // count of frees goes on rising, up to `quiet` after the last change and
  // `limit` in all.
  bool wait(std::chrono::microseconds quiet, std::chrono::microseconds limit) const {
    const auto start = std::chrono::steady_clock::now();
    auto last_change = start;
    uint64_t seen = count(frees());
    for (;;) {
      const uint64_t freed = count(frees());
      if (freed - frees_ >= count(mallocs()) - mallocs_) return true;
      const auto now = std::chrono::steady_clock::now();
      if (freed != seen) {
        seen = freed;
        last_change = now;
      }
      if (now - last_change >= quiet || now - start >= limit) return false;
      sched_yield();
    }
  }

 private:
  static std::atomic<uint64_t>& mallocs() {
    static std::atomic<uint64_t> n{0};
    return n;
  }
  static std::atomic<uint64_t>& frees() {
    static std::atomic<uint64_t> n{0};
    return n;
  }
  static uint64_t count(const std::atomic<uint64_t>& n) {
    return n.load(std::memory_order_acquire);
  }
  static void on_malloc(const volatile void*, size_t) {
    mallocs().fetch_add(1, std::memory_order_acq_rel);
  }
  static void on_free(const volatile void*) { frees().fetch_add(1, std::memory_order_acq_rel); }

  uint64_t mallocs_ = 0;
  uint64_t frees_ = 0;
};

}  // namespace ferry::fuzz
