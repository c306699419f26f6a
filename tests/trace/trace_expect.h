// What a finished tcp transfer's stage trace must hold (docs/trace.md),
// shared by the host-memory trace test and the GPU one
// (tests/gpu/tcp_gpu_memory_test.cc).
#pragma once

#include <string>
#include <vector>

#include "core/stage_trace.h"
#include "core/transfer.h"
#include "fmt/format.h"

namespace ferry::tracetest {

// Problems with `r` as the trace of a successful tcp transfer: a stage that
// must be set and is not, one set that cannot have happened (a GPU copy on
// host memory, target payload on a read), or stages out of order.
inline std::vector<std::string> check_tcp_record(const TraceRecord& r) {
  std::vector<std::string> bad;
  const auto op = static_cast<TransferOp>(r.op);
  const bool write = op == TransferOp::kWrite, read = op == TransferOp::kRead;
  auto want = [&](TraceStage s, bool must) {
    if (r.has(s) != must) {
      bad.push_back(fmt::format("{} {}", trace_stage_name(s), must ? "missing" : "set"));
    }
  };
  for (TraceStage s : {TraceStage::kPosted, TraceStage::kFirstFrameSent, TraceStage::kLastFrameSent,
                       TraceStage::kFrameReceived, TraceStage::kResponseSent,
                       TraceStage::kResponseReceived, TraceStage::kCompleted}) {
    want(s, true);
  }
  want(TraceStage::kStageCopySubmitted, write && r.local_gpu);
  want(TraceStage::kStageCopyDone, write && r.local_gpu);
  want(TraceStage::kPayloadReceived, write);
  want(TraceStage::kTargetCopySubmitted, r.remote_gpu && (write || read));
  want(TraceStage::kTargetCopyDone, r.remote_gpu && (write || read));
  want(TraceStage::kLandCopySubmitted, read && r.local_gpu);
  want(TraceStage::kLandCopyDone, read && r.local_gpu);
  if (r.status != StatusCode::kOk) {
    bad.push_back(fmt::format("status {}", status_code_name(r.status)));
  }
  if (r.frames == 0) bad.push_back("no request frame counted");
  for (auto& v : trace_order_violations(r)) bad.push_back(std::move(v));
  // The chain of the issue, spelled out (trace_order_violations covers it).
  const TraceStage chain[] = {TraceStage::kPosted,           TraceStage::kFirstFrameSent,
                              TraceStage::kFrameReceived,    TraceStage::kResponseSent,
                              TraceStage::kResponseReceived, TraceStage::kCompleted};
  for (size_t i = 1; i < std::size(chain); ++i) {
    if (r.has(chain[i - 1]) && r.has(chain[i]) && r.at(chain[i]) < r.at(chain[i - 1])) {
      bad.push_back(
          fmt::format("{} before {}", trace_stage_name(chain[i]), trace_stage_name(chain[i - 1])));
    }
  }
  return bad;
}

inline std::string describe(const TraceRecord& r) {
  std::string s =
      fmt::format("transfer {} op {} {} B frames {} local_gpu {} remote_gpu {}:", r.transfer, r.op,
                  r.bytes, r.frames, r.local_gpu, r.remote_gpu);
  for (size_t i = 0; i < kTraceStageCount; ++i) {
    if (r.ns[i] != 0) s += fmt::format(" {}=+{}", trace_stage_name(i), r.ns[i] - r.ns[0]);
  }
  return s;
}

}  // namespace ferry::tracetest
