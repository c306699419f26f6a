// The stage trace facility (src/core/stage_trace.h): stage names, first/last
// policies, the order check, completion into the engine's log, the bounded
// ring, and that an untraced transfer records nothing.
#include "core/stage_trace.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/transfer.h"

namespace ferry {
namespace {

TEST(StageTrace, NamesAreUniqueAndStable) {
  std::set<std::string> names;
  for (size_t i = 0; i < kTraceStageCount; ++i) {
    const std::string name(trace_stage_name(i));
    EXPECT_NE(name, "unknown") << "stage " << i;
    EXPECT_TRUE(names.insert(name).second) << name << " twice";
  }
  EXPECT_EQ(trace_stage_name(TraceStage::kPosted), "posted");
  EXPECT_EQ(trace_stage_name(TraceStage::kFrameReceived), "frame_received");
  EXPECT_EQ(trace_stage_name(TraceStage::kCompleted), "completed");
}

TEST(StageTrace, FirstStagesKeepTheFirstLaterOnesTheLatest) {
  StageTrace t(nullptr);
  t.mark(TraceStage::kFirstFrameSent, 100);
  t.mark(TraceStage::kFirstFrameSent, 50);  // a later call, an earlier time: ignored
  t.mark(TraceStage::kFirstFrameSent, 200);
  EXPECT_EQ(t.get(TraceStage::kFirstFrameSent), 100);
  t.mark(TraceStage::kLastFrameSent, 300);
  t.mark(TraceStage::kLastFrameSent, 250);  // frames finish out of order: keep the latest
  t.mark(TraceStage::kLastFrameSent, 400);
  EXPECT_EQ(t.get(TraceStage::kLastFrameSent), 400);
  EXPECT_TRUE(trace_stage_keeps_first(TraceStage::kPosted));
  EXPECT_TRUE(trace_stage_keeps_first(TraceStage::kStageCopyDone));
  EXPECT_FALSE(trace_stage_keeps_first(TraceStage::kLastFrameSent));
  EXPECT_FALSE(trace_stage_keeps_first(TraceStage::kResponseSent));
  EXPECT_EQ(t.get(TraceStage::kResponseReceived), 0) << "never marked: unset";
}

TEST(StageTrace, LatestWinsUnderConcurrentMarks) {
  StageTrace t(nullptr);
  std::vector<std::thread> threads;
  for (int k = 0; k < 8; ++k) {
    threads.emplace_back([&t, k] {
      for (int i = 1; i <= 10000; ++i) {
        t.mark(TraceStage::kResponseReceived, int64_t{i} * 8 + k);
        t.mark(TraceStage::kPosted, int64_t{i} * 8 + k);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(t.get(TraceStage::kResponseReceived), 10000 * 8 + 7);
  EXPECT_GE(t.get(TraceStage::kPosted), 8);  // one of the first marks, never overwritten
  EXPECT_LE(t.get(TraceStage::kPosted), 8 + 7);
}

TEST(StageTrace, RealMarksAreNonDecreasingInStageOrder) {
  StageTrace t(nullptr);
  for (size_t i = 0; i < kTraceStageCount; ++i) t.mark(static_cast<TraceStage>(i));
  const TraceRecord r = t.snapshot();
  for (size_t i = 0; i < kTraceStageCount; ++i) EXPECT_GT(r.ns[i], 0) << trace_stage_name(i);
  EXPECT_TRUE(trace_order_violations(r).empty());
}

TEST(StageTrace, OrderCheckNamesTheStagesOutOfOrder) {
  TraceRecord r;
  r.ns[static_cast<size_t>(TraceStage::kPosted)] = 10;
  r.ns[static_cast<size_t>(TraceStage::kFirstFrameSent)] = 20;
  r.ns[static_cast<size_t>(TraceStage::kFrameReceived)] = 15;  // before it was sent
  r.ns[static_cast<size_t>(TraceStage::kResponseSent)] = 30;
  r.ns[static_cast<size_t>(TraceStage::kCompleted)] = 40;
  const auto v = trace_order_violations(r);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_NE(v[0].find("frame_received"), std::string::npos) << v[0];
  EXPECT_NE(v[0].find("first_frame_sent"), std::string::npos) << v[0];
  // Unset stages are skipped, not read as time 0.
  TraceRecord sparse;
  sparse.ns[static_cast<size_t>(TraceStage::kPosted)] = 5;
  sparse.ns[static_cast<size_t>(TraceStage::kCompleted)] = 9;
  EXPECT_TRUE(trace_order_violations(sparse).empty());
}

TEST(StageTrace, CompletionLogsOnceBeforeWaitersWake) {
  auto log = std::make_shared<TraceLog>(16);
  Transfer t(7, TransferOp::kWrite, 99);
  t.bytes = 4096;
  t.trace = std::make_unique<StageTrace>(log);
  t.trace->set_memory(true, false);
  t.trace->mark(TraceStage::kPosted);
  std::thread waiter([&] {
    ASSERT_TRUE(t.wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(10)));
    // Finished implies logged.
    EXPECT_EQ(log->snapshot().size(), 1u);
  });
  t.complete(Status::Ok());
  t.complete(err::Internal("second completion is ignored"));
  waiter.join();
  const auto records = log->take();
  ASSERT_EQ(records.size(), 1u);
  const TraceRecord& r = records[0];
  EXPECT_EQ(r.transfer, 7u);
  EXPECT_EQ(r.peer, 99u);
  EXPECT_EQ(r.op, static_cast<uint8_t>(TransferOp::kWrite));
  EXPECT_EQ(r.bytes, 4096u);
  EXPECT_EQ(r.status, StatusCode::kOk);
  EXPECT_TRUE(r.local_gpu);
  EXPECT_FALSE(r.remote_gpu);
  EXPECT_TRUE(r.has(TraceStage::kPosted));
  EXPECT_TRUE(r.has(TraceStage::kCompleted));
  EXPECT_GE(r.at(TraceStage::kCompleted), r.at(TraceStage::kPosted));
  EXPECT_TRUE(log->take().empty());
}

TEST(StageTrace, OffRecordsNothing) {
  auto log = trace_log_for(0x5eed0001, 8);
  Transfer t(1, TransferOp::kRead, 2);  // no trace attached: tracing off
  EXPECT_EQ(t.trace, nullptr);
  t.complete(Status::Ok());
  EXPECT_TRUE(log->snapshot().empty());
  EXPECT_TRUE(engine_traces(0x5eed0001).empty());
  EXPECT_TRUE(engine_traces(0x5eed0002).empty()) << "an engine that never traced";
}

TEST(StageTrace, RingKeepsTheLastN) {
  TraceLog log(3);
  for (uint64_t i = 1; i <= 5; ++i) {
    TraceRecord r;
    r.transfer = i;
    log.append(r);
  }
  EXPECT_EQ(log.dropped(), 2u);
  const auto kept = log.take();
  ASSERT_EQ(kept.size(), 3u);
  EXPECT_EQ(kept[0].transfer, 3u);  // oldest first
  EXPECT_EQ(kept[2].transfer, 5u);
  EXPECT_EQ(log.dropped(), 0u);
}

TEST(StageTrace, OneLogPerEngineSharedByItsTransports) {
  auto a = trace_log_for(0x5eed0010, 4);
  auto b = trace_log_for(0x5eed0010, 100);  // the first capacity stays
  EXPECT_EQ(a, b);
  EXPECT_EQ(b->keep(), 4u);
  TraceRecord r;
  r.transfer = 42;
  a->append(r);
  ASSERT_EQ(engine_traces(0x5eed0010).size(), 1u);
  EXPECT_EQ(take_engine_traces(0x5eed0010)[0].transfer, 42u);
  EXPECT_TRUE(engine_traces(0x5eed0010).empty());
  a.reset();
  b.reset();  // the engine is gone: its log too
  EXPECT_TRUE(engine_traces(0x5eed0010).empty());
  EXPECT_EQ(trace_log_for(0x5eed0010, 9)->keep(), 9u);
}

}  // namespace
}  // namespace ferry
