// Per-transfer stage trace: when each step of one transfer happened, on both
// sides, in CLOCK_MONOTONIC nanoseconds (std::chrono::steady_clock). Compiled
// in, off by default; a transport switches it on by an option (tcp.trace).
//
// Cost. Off: Transfer::trace is null and every marking site is one branch on
// that pointer (no clock read, no allocation, no lock). On: one allocation per
// transfer, one clock read and at most one relaxed atomic store per stage and
// frame, and one short lock when the finished transfer is appended to its
// engine's TraceLog.
//
// Stages follow one transfer's path through the pipeline (the enum's order).
// A stage that does not occur for a transfer (no GPU copy on host memory, no
// target payload on a read) stays 0, unset. For a transfer of several frames
// each stage is a first or a last occurrence over its frames (kStagePolicy):
// the stages before and including first_frame_sent keep the first frame's
// time ("when the first frame got there"), the later ones the last frame's
// ("when every frame had got there"). Every frame passes the stages in enum
// order, each causally after the one before (the frame_sent stages are taken
// just *before* the sendmsg carrying the frame's first byte, so the peer can
// never receive it earlier), hence for each transfer the set stages are
// non-decreasing in enum order -- within the first-wins group, within the
// last-wins group, and from one group to the other (min <= own <= max).
//
// Target stages are taken by the target in its own process and sent back in
// the response (docs/protocol.md, "Stage trace trailer"); they are comparable
// with the initiator's only when both run on one host (one kernel clock).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry {

enum class TraceStage : uint8_t {
  // --- initiator ---
  kPosted = 0,          // the transport accepted the post (after core's checks)
  kStageCopySubmitted,  // first device->host copy into a staging slot handed to the GPU path
  kStageCopyDone,       // ... the first such copy finished
  kFirstFrameSent,      // the first request frame starts onto the socket
  kLastFrameSent,       // the last request frame starts onto the socket
  // --- target (carried back in the response) ---
  kFrameReceived,        // request header and segment table received
  kPayloadReceived,      // WRITE: payload in (host memory or the staging slot)
  kTargetCopySubmitted,  // WRITE into GPU (host->device) / READ of GPU (device->host) handed over
  kTargetCopyDone,       // ... finished
  kResponseSent,         // the response starts onto the socket
  // --- initiator ---
  kResponseReceived,   // the response is in (a READ's payload too)
  kLandCopySubmitted,  // READ into GPU: host->device copy from the staging slot handed over
  kLandCopyDone,       // ... finished
  kCompleted,          // the transfer is complete (Transfer::complete)
};
constexpr size_t kTraceStageCount = static_cast<size_t>(TraceStage::kCompleted) + 1;

// "posted", "stage_copy_submitted", ... (stable names: tools and JSON use them).
std::string_view trace_stage_name(TraceStage stage);
inline std::string_view trace_stage_name(size_t index) {
  return trace_stage_name(static_cast<TraceStage>(index));
}
// Stages up to and including kFirstFrameSent keep their first occurrence,
// later ones their last.
constexpr bool trace_stage_keeps_first(TraceStage stage) {
  return stage <= TraceStage::kFirstFrameSent;
}

// Nanoseconds of std::chrono::steady_clock (CLOCK_MONOTONIC on Linux); never 0.
inline int64_t trace_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One finished transfer's trace, a plain copy (what TraceLog keeps).
struct TraceRecord {
  TransferId transfer = 0;
  PeerId peer = 0;
  uint8_t op = 0;  // TransferOp
  bool local_gpu = false;
  bool remote_gpu = false;
  StatusCode status = StatusCode::kOk;
  uint64_t bytes = 0;
  uint32_t frames = 0;                         // request frames sent
  std::array<int64_t, kTraceStageCount> ns{};  // 0: the stage did not occur

  int64_t at(TraceStage s) const { return ns[static_cast<size_t>(s)]; }
  bool has(TraceStage s) const { return at(s) != 0; }
};

// Empty when the set stages are non-decreasing in enum order; else one line
// per pair out of order ("first_frame_sent 1200 ns after frame_received").
std::vector<std::string> trace_order_violations(const TraceRecord& record);

class TraceLog;

// The live trace of one transfer; any thread may mark it.
class StageTrace {
 public:
  explicit StageTrace(std::shared_ptr<TraceLog> sink) : sink_(std::move(sink)) {}

  // Records `ns` (default: now) for `stage` with the stage's policy: the
  // first occurrence or the latest time.
  void mark(TraceStage stage, int64_t ns = trace_now_ns());
  int64_t get(TraceStage stage) const {
    return ns_[static_cast<size_t>(stage)].load(std::memory_order_relaxed);
  }
  void count_frame() { frames_.fetch_add(1, std::memory_order_relaxed); }
  void set_memory(bool local_gpu, bool remote_gpu) {
    local_gpu_ = local_gpu;
    remote_gpu_ = remote_gpu;
  }

  // Marks kCompleted and appends the record to the sink (Transfer::complete
  // calls this once, before waiters wake: a waiter that returns finds its
  // transfer in the log).
  void finish(TransferId id, PeerId peer, uint8_t op, uint64_t bytes, StatusCode status);
  TraceRecord snapshot() const;

 private:
  std::array<std::atomic<int64_t>, kTraceStageCount> ns_{};
  std::atomic<uint32_t> frames_{0};
  bool local_gpu_ = false;  // set before the transfer's frames are published
  bool remote_gpu_ = false;
  std::shared_ptr<TraceLog> sink_;
};

// The last `keep` finished traced transfers of one engine (a bounded ring).
class TraceLog {
 public:
  explicit TraceLog(size_t keep) : keep_(keep == 0 ? 1 : keep) {}
  void append(const TraceRecord& record);
  // Oldest first; take() also empties the log.
  std::vector<TraceRecord> snapshot() const;
  std::vector<TraceRecord> take();
  // Records pushed out of the ring since the last take().
  uint64_t dropped() const;
  size_t keep() const { return keep_; }

 private:
  std::vector<TraceRecord> ordered_locked() const;  // mu_ held
  mutable std::mutex mu_;
  const size_t keep_;
  std::vector<TraceRecord> ring_;
  size_t next_ = 0;  // where the next record goes once the ring is full
  uint64_t dropped_ = 0;
};

// The log of engine `engine_id`, shared by its transports: created on the
// first call with `keep` (later calls keep the first capacity). Transports
// hold the returned pointer; the process-wide table only keeps weak ones.
std::shared_ptr<TraceLog> trace_log_for(uint64_t engine_id, size_t keep);
// The traced transfers engine `engine_id` finished (oldest first), and with
// take_traces the log is emptied. Empty when the engine traces nothing.
// (Internal accessor until the public Engine API has one.)
std::vector<TraceRecord> engine_traces(uint64_t engine_id);
std::vector<TraceRecord> take_engine_traces(uint64_t engine_id);

}  // namespace ferry
