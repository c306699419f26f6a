#include "core/stage_trace.h"

#include <unordered_map>

#include "fmt/format.h"

namespace ferry {

std::string_view trace_stage_name(TraceStage stage) {
  switch (stage) {
    case TraceStage::kPosted:
      return "posted";
    case TraceStage::kStageCopySubmitted:
      return "stage_copy_submitted";
    case TraceStage::kStageCopyDone:
      return "stage_copy_done";
    case TraceStage::kFirstFrameSent:
      return "first_frame_sent";
    case TraceStage::kLastFrameSent:
      return "last_frame_sent";
    case TraceStage::kFrameReceived:
      return "frame_received";
    case TraceStage::kPayloadReceived:
      return "payload_received";
    case TraceStage::kTargetCopySubmitted:
      return "target_copy_submitted";
    case TraceStage::kTargetCopyDone:
      return "target_copy_done";
    case TraceStage::kResponseSent:
      return "response_sent";
    case TraceStage::kResponseReceived:
      return "response_received";
    case TraceStage::kLandCopySubmitted:
      return "land_copy_submitted";
    case TraceStage::kLandCopyDone:
      return "land_copy_done";
    case TraceStage::kCompleted:
      return "completed";
  }
  return "unknown";
}

std::vector<std::string> trace_order_violations(const TraceRecord& record) {
  std::vector<std::string> out;
  size_t prev = kTraceStageCount;  // the last set stage so far
  for (size_t i = 0; i < kTraceStageCount; ++i) {
    if (record.ns[i] == 0) continue;
    if (prev != kTraceStageCount && record.ns[i] < record.ns[prev]) {
      out.push_back(fmt::format("{} {} ns before {}", trace_stage_name(i),
                                record.ns[prev] - record.ns[i], trace_stage_name(prev)));
    }
    // Compare against the latest set stage, so one early outlier is reported
    // once, not for every stage after it.
    if (prev == kTraceStageCount || record.ns[i] >= record.ns[prev]) prev = i;
  }
  return out;
}

void StageTrace::mark(TraceStage stage, int64_t ns) {
  std::atomic<int64_t>& slot = ns_[static_cast<size_t>(stage)];
  int64_t seen = slot.load(std::memory_order_relaxed);
  if (trace_stage_keeps_first(stage)) {
    if (seen == 0) slot.compare_exchange_strong(seen, ns, std::memory_order_relaxed);
    return;
  }
  // The latest time wins (frames finish on several threads, in any order).
  while (ns > seen && !slot.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
  }
}

TraceRecord StageTrace::snapshot() const {
  TraceRecord r;
  for (size_t i = 0; i < kTraceStageCount; ++i) r.ns[i] = ns_[i].load(std::memory_order_relaxed);
  r.frames = frames_.load(std::memory_order_relaxed);
  r.local_gpu = local_gpu_;
  r.remote_gpu = remote_gpu_;
  return r;
}

void StageTrace::finish(TransferId id, PeerId peer, uint8_t op, uint64_t bytes, StatusCode status) {
  mark(TraceStage::kCompleted);
  if (!sink_) return;
  TraceRecord r = snapshot();
  r.transfer = id;
  r.peer = peer;
  r.op = op;
  r.bytes = bytes;
  r.status = status;
  sink_->append(r);
}

void TraceLog::append(const TraceRecord& record) {
  std::lock_guard lock(mu_);
  if (ring_.size() < keep_) {
    ring_.push_back(record);
    return;
  }
  ring_[next_] = record;
  next_ = (next_ + 1) % keep_;
  ++dropped_;
}

std::vector<TraceRecord> TraceLog::ordered_locked() const {
  std::vector<TraceRecord> out;
  out.reserve(ring_.size());
  for (size_t i = 0; i < ring_.size(); ++i) out.push_back(ring_[(next_ + i) % ring_.size()]);
  return out;
}

std::vector<TraceRecord> TraceLog::snapshot() const {
  std::lock_guard lock(mu_);
  return ordered_locked();
}

std::vector<TraceRecord> TraceLog::take() {
  std::lock_guard lock(mu_);
  std::vector<TraceRecord> out = ordered_locked();
  ring_.clear();
  next_ = 0;
  dropped_ = 0;
  return out;
}

uint64_t TraceLog::dropped() const {
  std::lock_guard lock(mu_);
  return dropped_;
}

namespace {
std::mutex g_logs_mu;
std::unordered_map<uint64_t, std::weak_ptr<TraceLog>>& logs() {
  static auto* table = new std::unordered_map<uint64_t, std::weak_ptr<TraceLog>>();
  return *table;
}
std::shared_ptr<TraceLog> find_log(uint64_t engine_id) {
  std::lock_guard lock(g_logs_mu);
  auto it = logs().find(engine_id);
  return it == logs().end() ? nullptr : it->second.lock();
}
}  // namespace

std::shared_ptr<TraceLog> trace_log_for(uint64_t engine_id, size_t keep) {
  std::lock_guard lock(g_logs_mu);
  auto& table = logs();
  for (auto it = table.begin(); it != table.end();) {  // engines gone since
    it = it->second.expired() ? table.erase(it) : std::next(it);
  }
  if (auto it = table.find(engine_id); it != table.end()) {
    if (auto log = it->second.lock()) return log;
  }
  auto log = std::make_shared<TraceLog>(keep);
  table[engine_id] = log;
  return log;
}

std::vector<TraceRecord> engine_traces(uint64_t engine_id) {
  auto log = find_log(engine_id);
  return log ? log->snapshot() : std::vector<TraceRecord>{};
}

std::vector<TraceRecord> take_engine_traces(uint64_t engine_id) {
  auto log = find_log(engine_id);
  return log ? log->take() : std::vector<TraceRecord>{};
}

}  // namespace ferry
