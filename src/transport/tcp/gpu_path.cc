#include "transport/tcp/gpu_path.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "fmt/format.h"

namespace ferry::tcp {
namespace {

// Completion threads: FERRY_TCP_GPU_COMPLETION_THREADS (1..16, a diagnostic
// knob), else 4.
size_t completion_threads() {
  if (const char* v = std::getenv("FERRY_TCP_GPU_COMPLETION_THREADS"); v != nullptr && *v != 0) {
    const long n = std::strtol(v, nullptr, 10);
    if (n >= 1 && n <= 16) return static_cast<size_t>(n);
  }
  return 4;
}

}  // namespace

Result<std::unique_ptr<GpuPath>> GpuPath::create(size_t staging_bytes, uint32_t sm_budget) {
  std::string reason;
  if (!cuda_available(&reason)) return err::NotSupported("GPU memory over tcp: " + reason);
  const size_t slots = std::max<size_t>(2, staging_bytes / kGpuFramePayload);
  auto pool = StagingPool::create(kGpuFramePayload, slots);
  if (!pool.ok()) return pool.status();
  return std::unique_ptr<GpuPath>(new GpuPath(std::move(pool.value()), sm_budget));
}

GpuPath::GpuPath(std::unique_ptr<StagingPool> pool, uint32_t sm_budget)
    : pool_(std::move(pool)), sm_budget_(sm_budget) {
  if (const char* v = std::getenv("FERRY_TCP_GPU_TRACE"); v != nullptr && *v == '1') {
    tracing_ = true;
  }
  const size_t n = completion_threads();
  for (size_t i = 0; i < n; ++i) completion_threads_.emplace_back([this] { completion_loop(); });
  job_thread_ = std::thread([this] { job_loop(); });
  submit_thread_ = std::thread([this] { submit_loop(); });
}

GpuPath::~GpuPath() {
  // Jobs may still queue copies, and queued copies still produce waits:
  // drain in that order.
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  job_thread_.join();
  submit_thread_.join();
  {
    std::lock_guard lock(mu_);
    stop_completion_ = true;
  }
  cv_.notify_all();
  for (auto& t : completion_threads_) t.join();
  if (tracing_ && !trace_.empty()) {
    const char* names[4] = {"queued for submit", "in submit", "submit end to seen done",
                            "in callback"};
    std::fprintf(stderr, "ferry tcp gpu trace: %zu frames (us: p50 / p90 / p99 / max)\n",
                 trace_.size());
    for (size_t k = 0; k < 4; ++k) {
      std::vector<float> v;
      v.reserve(trace_.size());
      for (const auto& t : trace_) v.push_back(t[k]);
      std::sort(v.begin(), v.end());
      auto at = [&](double q) {
        return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
      };
      std::fprintf(stderr, "  %-24s %8.1f %8.1f %8.1f %8.1f\n", names[k], at(0.5), at(0.9),
                   at(0.99), v.back());
    }
  }
}

void GpuPath::trace(const Waiting& w, Clock::time_point seen, Clock::time_point returned) {
  auto us = [](Clock::duration d) {
    return static_cast<float>(std::chrono::duration<double, std::micro>(d).count());
  };
  std::lock_guard lock(trace_mu_);
  trace_.push_back({us(w.submit_begin - w.queued), us(w.submit_end - w.submit_begin),
                    us(seen - w.submit_end), us(returned - seen)});
}

Result<std::unique_ptr<StagingSlot>> GpuPath::acquire_slot() {
  return pool_->acquire(std::chrono::seconds(30));
}

Result<CopyStream*> GpuPath::stream(int device) {
  std::lock_guard lock(streams_mu_);
  auto& s = streams_[device];
  if (!s) {
    CopyOptions options;
    options.sm_budget = sm_budget_;
    // Diagnostic knobs (measurement only): FERRY_TCP_GPU_KERNEL_MAX_BLOCK
    // (bytes) and FERRY_TCP_GPU_BATCH_API (0: one cudaMemcpyAsync per
    // copy-engine piece instead of cudaMemcpyBatchAsync).
    if (const char* v = std::getenv("FERRY_TCP_GPU_KERNEL_MAX_BLOCK"); v != nullptr && *v != 0) {
      options.kernel_max_block = std::strtoull(v, nullptr, 10);
    }
    if (const char* v = std::getenv("FERRY_TCP_GPU_BATCH_API"); v != nullptr && *v != 0) {
      options.use_batch_api = std::strtol(v, nullptr, 10) != 0;
    }
    auto created = CopyStream::create(device, options);
    if (!created.ok()) return created.status();
    s = std::move(created.value());
  }
  return s.get();
}

void GpuPath::copy_then(std::vector<DeviceCopy> copies, std::function<void(Status)> done) {
  {
    std::lock_guard lock(mu_);
    submits_.push_back(Submit{std::move(copies), std::move(done), Clock::now()});
  }
  cv_.notify_all();
}

void GpuPath::submit_loop() {
  for (;;) {
    Submit job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !submits_.empty(); });
      if (submits_.empty()) return;
      job = std::move(submits_.front());
      submits_.pop_front();
    }
    Waiting w;
    w.done = std::move(job.done);
    w.queued = job.queued;
    w.submit_begin = Clock::now();
    // One submit per device, each a batch on that device's stream.
    std::map<int, std::vector<CopyBlock>> by_device;
    for (const auto& c : job.copies) by_device[c.device].push_back(c.block);
    for (auto& [device, blocks] : by_device) {
      auto s = stream(device);
      if (!s.ok()) {
        w.submit_error = s.status();
        break;
      }
      auto ticket = (*s)->submit(blocks);
      if (!ticket.ok()) {
        w.submit_error = ticket.status();
        break;
      }
      w.tickets.emplace_back(*s, *ticket);
    }
    w.submit_end = Clock::now();
    {
      std::lock_guard lock(mu_);
      waiting_.push_back(std::move(w));
    }
    cv_.notify_all();
  }
}

void GpuPath::run(std::function<void()> job) {
  {
    std::lock_guard lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void GpuPath::completion_loop() {
  for (;;) {
    Waiting w;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_completion_ || !waiting_.empty(); });
      if (waiting_.empty()) return;
      w = std::move(waiting_.front());
      waiting_.pop_front();
    }
    Status status = w.submit_error;
    for (auto& [stream, ticket] : w.tickets) {
      Status s = wait(stream, ticket);
      if (status.ok() && !s.ok()) status = s;
    }
    if (!status.ok()) {
      status = Status(status.code(), "GPU staging copy failed: " + status.message());
    }
    const auto seen = Clock::now();
    w.done(status);
    if (tracing_) trace(w, seen, Clock::now());
  }
}

// Like CopyStream::wait, but the back-off stops at 20 us instead of 500 us: a
// staging copy takes ~20 us (1 MiB at PCIe speed) and the frame waits for it.
Status GpuPath::wait(CopyStream* stream, uint64_t ticket) {
  const auto start = std::chrono::steady_clock::now();
  auto nap = std::chrono::microseconds(0);
  for (;;) {
    Status s = stream->poll(ticket);
    if (s.code() != StatusCode::kInProgress) return s;
    if (nap.count() == 0) {
      std::this_thread::yield();
      if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(30)) {
        nap = std::chrono::microseconds(2);
      }
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(20));
    }
  }
}

void GpuPath::job_loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace ferry::tcp
