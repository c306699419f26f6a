// The per-peer window: a bound on the work in flight to one peer (docs/
// reliability.md, "A slow peer"). A peer that drains slowly or not at all
// would otherwise let a posting loop queue transfers, frames and their
// bookkeeping without limit; with the window a call waits for room, then
// fails with Busy naming the peer, the bound and what is outstanding.
//
// Transport-independent: core takes room before a transfer reaches its
// transport and the transfer gives it back when it completes, whichever way
// (done, failed, cancelled), so every transport is bounded the same way.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry {

class PeerWindows {
 public:
  using Clock = std::chrono::steady_clock;
  struct Limits {
    uint64_t bytes = UINT64_MAX;  // payload bytes in flight to one peer
    uint64_t iovs = UINT64_MAX;   // segments in flight (a notification counts one)
  };
  struct Usage {
    uint64_t bytes = 0;
    uint64_t iovs = 0;
    uint64_t transfers = 0;
  };

  void configure(Limits limits) { limits_ = limits; }
  const Limits& limits() const { return limits_; }

  // Takes room for one transfer of `bytes` and `iovs` to `peer`, waiting
  // until `deadline` for earlier transfers to give theirs back. A transfer
  // always fits a window with nothing in flight, however large, so no call
  // is refused for its size alone. Busy when the deadline passes first.
  Status acquire(PeerId peer, uint64_t bytes, uint64_t iovs, Clock::time_point deadline);
  // Gives back what acquire() took.
  void release(PeerId peer, uint64_t bytes, uint64_t iovs);
  Usage usage(PeerId peer) const;

 private:
  // One per peer with work in flight or a caller waiting: a completion wakes
  // only the callers waiting for that peer's room (a fast peer's thousands
  // of completions a second must not wake a thread waiting on a slow one).
  struct PeerState {
    Usage used;
    uint32_t waiters = 0;
    std::condition_variable room;
  };
  bool fits(const Usage& used, uint64_t bytes, uint64_t iovs) const;

  Limits limits_;
  mutable std::mutex mu_;
  std::unordered_map<PeerId, PeerState> peers_;  // under mu_; nodes stay put
};

}  // namespace ferry
