// The worker's state, shared by its command handling (soak_worker.cc) and its
// traffic (soak_traffic.cc). One mutex guards everything but the engine.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../integration/test_util.h"
#include "ferry/engine.h"
#include "soak_config.h"
#include "soak_lines.h"
#include "soak_memory.h"
#include "soak_util.h"

namespace ferry::soak {

// This process's slot in a peer's target area.
struct Slot {
  bool busy = false;   // a transfer of ours is on it
  bool known = false;  // its content is the pattern of (cseed) over [0, bytes)
  uint64_t cseed = 0;
  uint64_t bytes = 0;
  uint64_t gen = 0;        // last generation written
  uint64_t await_gen = 0;  // a write with a notification whose acknowledgement we wait for
  bool await_ok = false;   // ... that completed (no acknowledgement = a lost notification)
  int64_t await_since = 0;
  uint64_t last_acked = 0;
  std::string history;  // the last writes' outcomes, for error messages
};

// A readable region a peer registered and announced.
struct PeerRegion {
  bool valid = false;
  uint64_t gen = 0, seed = 0, length = 0;
  RemoteDescriptor desc;
};

// A stretch of time in which errors on transfers with a peer are expected:
// it was killed, or stopped (or we were).
struct FaultWindow {
  int64_t start = 0;
  int64_t end = INT64_MAX;
  bool kill = false;
  uint32_t incarnation = 0;  // of the peer killed
};

struct PeerState {
  bool known = false;
  uint32_t incarnation = 0;
  uint64_t engine_id = 0;
  Bytes metadata;
  RemoteDescriptor target, fixed;  // its target area, its static region
  PeerRegion region;
  PeerId id = 0;
  bool connected = false, connecting = false;
  std::vector<Slot> slots;
  // As its target: the last generation of each of its slots notified, for
  // its incarnation `seen_incarnation`.
  uint32_t seen_incarnation = 0;
  std::vector<uint64_t> seen_gen;
  std::vector<FaultWindow> windows;
};

// An error that a fault may explain; judged a few seconds after it happened.
struct Suspect {
  int peer = -1;
  uint32_t incarnation = 0;
  int64_t posted = 0, done = 0;
  StatusCode code = StatusCode::kOk;
  std::string what;
};

// One registered region of ours that peers read.
struct OwnRegion {
  uint64_t gen = 0;
  std::unique_ptr<SoakMemory> memory;
  RegionId id = 0;
};

class Worker {
 public:
  Worker(const SoakConfig& config, int index, uint32_t incarnation);
  int Run();

 private:
  // soak_worker.cc
  bool Setup();
  void HandleCommand(const std::string& line);
  void NotificationLoop();
  void OnWriteNotification(const Notification& n, const std::vector<std::string>& f);
  void OnAcknowledgement(const std::vector<std::string>& f);
  void RotateRegion();
  void Housekeeping(bool final);
  void JudgeSuspects(bool all);
  void Drain();
  std::string StatsLine();
  // soak_traffic.cc
  void TrafficLoop(int thread);

 public:  // used by the traffic threads
  void Count(const std::string& key, uint64_t n = 1);
  void CountError(const std::string& kind, const Status& s, bool expected);
  void DataError(const std::string& text);
  void Suspicious(int peer, uint32_t incarnation, int64_t posted, const Status& s,
                  const std::string& what);
  void Latency(int64_t ns);
  // Moves `m`'s host view to the memory (to_memory) or back; a failed copy
  // is an unexpected error, counted and reported.
  bool Move(SoakMemory& m, bool to_memory, uint64_t offset, uint64_t length);
  uint64_t SlotOffset(int source, int slot) const {
    return (static_cast<uint64_t>(source) * config_.slots + slot) * config_.max_bytes;
  }
  uint64_t ScratchOffset() const {
    return static_cast<uint64_t>(config_.processes) * config_.slots * config_.max_bytes;
  }
  const SoakConfig& config() const { return config_; }
  int device() const { return device_; }
  int index() const { return index_; }
  uint32_t incarnation() const { return incarnation_; }
  Engine& engine() { return *engine_; }
  std::mutex& mu() { return mu_; }
  std::vector<PeerState>& peers() { return peers_; }
  bool stopping() const { return stopping_.load(); }
  LineWriter& out() { return out_; }

 private:
  SoakConfig config_;
  int index_;
  uint32_t incarnation_;
  LineWriter out_;
  std::unique_ptr<Engine> engine_;
  int device_ = -1;                    // our GPU (--memory gpu)
  std::unique_ptr<SoakMemory> area_;   // the target area (slots of every source, then scratch)
  std::unique_ptr<SoakMemory> fixed_;  // the static region
  RegionId area_id_ = 0, fixed_id_ = 0;
  std::deque<OwnRegion> regions_;
  uint64_t region_gen_ = 0;
  std::mt19937_64 rng_;

  std::mutex mu_;
  std::vector<PeerState> peers_;
  std::vector<FaultWindow> self_windows_;  // we were stopped
  std::vector<Suspect> suspects_;
  std::map<std::string, uint64_t> counters_;
  Histogram latency_;
  int error_lines_ = 0;
  std::string carrier_;
  int64_t max_fail_ns_ = 0;

  std::atomic<uint64_t> data_errors_{0};
  std::atomic<bool> go_{false}, stopping_{false}, exiting_{false};
};

}  // namespace ferry::soak
