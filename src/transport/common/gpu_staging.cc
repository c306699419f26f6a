#include "transport/common/gpu_staging.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "core/cpu_relax.h"
#include "core/thread_name.h"
#include "fmt/format.h"

namespace ferry::staging {
namespace {

// Callback threads: FERRY_<USER>_GPU_COMPLETION_THREADS (1..16, a
// diagnostic knob), else 4.
size_t completion_threads(const char* v) {
  if (v != nullptr && *v != 0) {
    const long n = std::strtol(v, nullptr, 10);
    if (n >= 1 && n <= 16) return static_cast<size_t>(n);
  }
  return 4;
}

// Inline copies run on streams of the calling thread's lane: threads that
// copy at the same time (the I/O threads of several frames in flight) then
// neither queue behind one another's copies on one CUDA stream nor take
// turns at that stream's lock while they poll. Threads beyond kInlineLanes
// share lanes.
constexpr uint32_t kInlineLanes = 16;

// Streams for handed-off copies (GpuPath::stream), beyond the inline lanes.
constexpr uint32_t kHandoffLanes = 4;

// How long the watcher stays awake after a handed-off copy (see watch_loop).
constexpr std::chrono::microseconds kWatcherLinger{200};
uint32_t inline_lane() {
  static std::atomic<uint32_t> next{0};
  thread_local const uint32_t lane = next.fetch_add(1, std::memory_order_relaxed) % kInlineLanes;
  return lane;
}

thread_local bool t_on_watcher = false;

}  // namespace

bool GpuPath::on_watcher() {
  return t_on_watcher;
}

Result<std::unique_ptr<GpuPath>> GpuPath::create(const GpuPathOptions& options,
                                                 const std::string& thread_prefix) {
  std::string reason;
  if (!cuda_available(&reason)) {
    return err::NotSupported("GPU memory over " + options.user + ": " + reason);
  }
  if (options.slot_bytes == 0) {
    return err::InvalidArgument("GPU staging for " + options.user + ": slot size 0");
  }
  GpuPathOptions opt = options;
  const std::string handoff_knob = env_name(options.user, "HANDOFF_US");
  if (const char* v = std::getenv(handoff_knob.c_str()); v != nullptr && *v != 0) {
    char* end = nullptr;
    const unsigned long long us = std::strtoull(v, &end, 10);
    if (*end != 0 || v[0] == '-' || us > 1000000) {
      return err::InvalidArgument(handoff_knob + "=" + v +
                                  ": expected microseconds (0 = never hand off, at most 1000000)");
    }
    opt.handoff_window = std::chrono::microseconds(us);
  }
  const size_t slots = std::max<size_t>(2, opt.staging_bytes / opt.slot_bytes);
  auto pool = StagingPool::create(opt.slot_bytes, slots);
  if (!pool.ok()) return pool.status();
  return std::unique_ptr<GpuPath>(new GpuPath(std::move(pool.value()), opt, thread_prefix));
}

GpuPath::GpuPath(std::unique_ptr<StagingPool> pool, const GpuPathOptions& options,
                 const std::string& thread_prefix)
    : pool_(std::move(pool)), opt_(options) {
  if (const char* v = env("TRACE"); v != nullptr && *v == '1') tracing_ = true;
  if (const char* v = env("INLINE_ENGINE"); v != nullptr && *v == '0') inline_engine_ = false;
  handoff_window_ = options.handoff_window;
  const size_t n = completion_threads(env("COMPLETION_THREADS"));
  for (size_t i = 0; i < n; ++i) {
    callback_threads_.emplace_back([this, thread_prefix] {
      name_this_thread(thread_prefix + "-gpu-cb");
      callback_loop();
    });
  }
  watch_thread_ = std::thread([this, thread_prefix] {
    name_this_thread(thread_prefix + "-gpu-poll");
    watch_loop();
  });
  job_thread_ = std::thread([this, thread_prefix] {
    name_this_thread(thread_prefix + "-gpu-job");
    job_loop();
  });
  submit_thread_ = std::thread([this, thread_prefix] {
    name_this_thread(thread_prefix + "-gpu-sub");
    submit_loop();
  });
}

GpuPath::~GpuPath() {
  // Jobs may still queue copies, queued copies still produce waits, and
  // finished waits still have callbacks to run: drain in that order.
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  submit_cv_.notify_all();
  job_cv_.notify_all();
  job_thread_.join();
  submit_thread_.join();
  {
    std::lock_guard lock(mu_);
    stop_watch_ = true;
  }
  watch_cv_.notify_all();
  watch_thread_.join();
  {
    std::lock_guard lock(mu_);
    stop_callbacks_ = true;
  }
  callback_cv_.notify_all();
  for (auto& t : callback_threads_) t.join();
  pool_->drop_waiters();
  if (tracing_ && !trace_.empty()) {
    const char* names[4] = {"queued for submit", "in submit", "submit end to seen done",
                            "in callback"};
    std::fprintf(stderr, "ferry %s gpu trace: %zu frames (us: p50 / p90 / p99 / max)\n",
                 opt_.user.c_str(), trace_.size());
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

std::string GpuPath::env_name(const std::string& user, const char* knob) {
  std::string name = "FERRY_";
  for (char c : user) name += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  name += "_GPU_";
  name += knob;
  return name;
}

const char* GpuPath::env(const char* knob) const {
  return std::getenv(env_name(opt_.user, knob).c_str());
}

std::pair<uint8_t*, size_t> GpuPath::staging_memory() const {
  return {pool_->base(), pool_->slot_bytes() * pool_->slot_count()};
}

std::unique_ptr<StagingSlot> GpuPath::slot_or_later(
    std::function<void(std::unique_ptr<StagingSlot>)> later) {
  // The releaser may hold its own locks (a stream's tx_mu, a transfer's
  // io_mu): the waiter only posts the slot on to the job thread.
  auto take = std::make_shared<std::function<void(std::unique_ptr<StagingSlot>)>>(std::move(later));
  return pool_->acquire_or_queue([this, take](std::unique_ptr<StagingSlot> slot) {
    auto held = std::make_shared<std::unique_ptr<StagingSlot>>(std::move(slot));
    run([take, held] { (*take)(std::move(*held)); });
  });
}

Result<CopyStream*> GpuPath::stream(int device, StreamUse use, bool after_default_stream,
                                    bool handed_off) {
  // A handed-off copy takes the next of kHandoffLanes streams: the copies of
  // several transfers in flight then run side by side on the copy engines
  // rather than one after another on the posting thread's stream (8 in
  // flight queued ~40 us there, H100 machine).
  thread_local uint32_t next_handoff = 0;
  const uint32_t lane = use == StreamUse::kQueued ? 0
                        : handed_off              ? kInlineLanes + (next_handoff++ % kHandoffLanes)
                                                  : inline_lane();
  std::lock_guard lock(streams_mu_);
  auto& s = streams_[{device, use, after_default_stream, lane}];
  if (!s) {
    CopyOptions options;
    options.sm_budget = use == StreamUse::kInlineEngine ? 0 : opt_.sm_budget;
    options.after_default_stream = after_default_stream;
    // Diagnostic knobs (measurement only): FERRY_<USER>_GPU_KERNEL_MAX_BLOCK
    // (bytes) and FERRY_<USER>_GPU_BATCH_API (0: one cudaMemcpyAsync per
    // copy-engine piece instead of cudaMemcpyBatchAsync).
    if (const char* v = env("KERNEL_MAX_BLOCK"); v != nullptr && *v != 0) {
      options.kernel_max_block = std::strtoull(v, nullptr, 10);
    }
    if (const char* v = env("BATCH_API"); v != nullptr && *v != 0) {
      options.use_batch_api = std::strtol(v, nullptr, 10) != 0;
    }
    auto created = CopyStream::create(device, options);
    if (!created.ok()) return created.status();
    s = std::move(created.value());
  }
  return s.get();
}

template <typename T>
bool GpuPath::take(std::condition_variable& cv, std::deque<T>& queue, const bool& stop, T* out) {
  std::unique_lock lock(mu_);
  cv.wait(lock, [&] { return stop || !queue.empty(); });
  if (queue.empty()) return false;
  *out = std::move(queue.front());
  queue.pop_front();
  return true;
}

bool GpuPath::inline_eligible(const std::vector<DeviceCopy>& copies) const {
  if (copies.empty()) return false;
  uint64_t bytes = 0;
  for (const auto& c : copies) {
    if (c.device != copies.front().device) return false;
    bytes += c.block.size;
  }
  return bytes <= opt_.inline_bytes;
}

bool GpuPath::submit_inline(const std::vector<DeviceCopy>& copies, bool after_default_stream,
                            bool hand_off, InlineCopy* out, const DefaultStreamMark* after) {
  if (out->w.queued == Clock::time_point{}) out->w.queued = Clock::now();
  out->w.submit_begin = Clock::now();
  auto s =
      stream(copies.front().device,
             copies.size() == 1 && inline_engine_ ? StreamUse::kInlineEngine : StreamUse::kInline,
             after_default_stream, hand_off);
  if (!s.ok()) return false;  // the queued path reports it
  std::vector<CopyBlock> blocks;
  blocks.reserve(copies.size());
  for (const auto& c : copies) blocks.push_back(c.block);
  out->stream = *s;
  if (Status ordered = after != nullptr ? after->order(copies.front().device, (*s)->native_stream())
                                        : Status::Ok();
      !ordered.ok()) {
    out->ticket = ordered;  // reported by finish_inline
  } else {
    out->ticket = (*s)->submit(blocks);
  }
  out->w.submit_end = Clock::now();
  return true;
}

void GpuPath::finish_inline(InlineCopy& c, std::function<void(Status)>& done, bool hand_off) {
  if (!c.ticket.ok()) {
    done(Status(c.ticket.status().code(),
                "GPU staging copy failed: " + c.ticket.status().message()));
    return;
  }
  // Spin: the copy takes a few microseconds, a sleep or a yield longer.
  const auto give_up = c.w.submit_end + opt_.inline_wait;
  for (uint32_t k = 0; !hand_off; ++k) {
    Status st = c.stream->poll(*c.ticket);
    if (st.code() != StatusCode::kInProgress) {
      if (!st.ok()) st = Status(st.code(), "GPU staging copy failed: " + st.message());
      const auto seen = Clock::now();
      done(st);
      if (tracing_) trace(c.w, seen, Clock::now());
      return;
    }
    if ((k & 63) == 63 && Clock::now() >= give_up) break;
    for (int r = 0; r < 4; ++r) cpu_relax();
  }
  // Handed off, or still running (a busy GPU): the watcher takes it from
  // here. A handed-off copy is small: the watcher runs `done` itself rather
  // than wake a callback thread for it.
  c.w.tickets.emplace_back(c.stream, *c.ticket);
  c.w.done = std::move(done);
  c.w.done_on_watcher = hand_off;
  {
    std::lock_guard lock(mu_);
    waiting_.push_back(std::move(c.w));
    waiting_count_.fetch_add(1, std::memory_order_release);
  }
  watch_cv_.notify_one();
}

bool GpuPath::copy_inline(std::vector<DeviceCopy>& copies, std::function<void(Status)>& done,
                          bool after_default_stream, const DefaultStreamMark* after) {
  if (!inline_eligible(copies)) return false;
  InlineCopy c;
  c.w.queued = Clock::now();
  // A thread posting copies close together (several transfers in flight)
  // does not wait for them; the watcher finishes them (see handoff_window_).
  // Per thread: the I/O threads of a target, each copying the frames of its
  // own stream, keep spinning in parallel rather than funnel into the watcher.
  thread_local Clock::time_point last_inline{};
  const bool hand_off =
      handoff_window_.count() > 0 && c.w.queued - last_inline < Clock::duration(handoff_window_);
  last_inline = c.w.queued;
  if (!submit_inline(copies, after_default_stream, hand_off, &c, after)) return false;
  finish_inline(c, done, hand_off);
  return true;
}

void GpuPath::copy_each_then(std::vector<std::vector<DeviceCopy>> groups,
                             std::vector<std::function<void(Status)>> done,
                             bool after_default_stream) {
  bool all_inline = groups.size() > 1;
  for (const auto& g : groups) {
    all_inline =
        all_inline && inline_eligible(g) && g.front().device == groups.front().front().device;
  }
  std::vector<InlineCopy> submitted(all_inline ? groups.size() : 0);
  for (size_t k = 0; k < submitted.size(); ++k) {
    if (!submit_inline(groups[k], after_default_stream, false, &submitted[k])) {
      // No stream: what was submitted finishes here, the rest is queued
      // (and reports the error).
      for (size_t j = 0; j < k; ++j) finish_inline(submitted[j], done[j], false);
      for (size_t j = k; j < groups.size(); ++j) {
        copy_then(std::move(groups[j]), std::move(done[j]), after_default_stream);
      }
      return;
    }
  }
  if (all_inline) {
    // Every copy is queued on the GPU before the first is waited for: the
    // first frame goes out while the later copies still run.
    for (size_t k = 0; k < submitted.size(); ++k) finish_inline(submitted[k], done[k], false);
    return;
  }
  for (size_t k = 0; k < groups.size(); ++k) {
    copy_then(std::move(groups[k]), std::move(done[k]), after_default_stream);
  }
}

void GpuPath::copy_then(std::vector<DeviceCopy> copies, std::function<void(Status)> done,
                        bool after_default_stream, std::shared_ptr<const DefaultStreamMark> after) {
  if (copy_inline(copies, done, after_default_stream, after.get())) return;
  {
    std::lock_guard lock(mu_);
    submits_.push_back(Submit{std::move(copies), std::move(done), Clock::now(),
                              after_default_stream, std::move(after)});
  }
  submit_cv_.notify_one();
}

void GpuPath::submit_loop() {
  for (;;) {
    Submit job;
    if (!take(submit_cv_, submits_, stop_, &job)) return;
    Waiting w;
    w.done = std::move(job.done);
    w.queued = job.queued;
    w.submit_begin = Clock::now();
    // One submit per device, each a batch on that device's stream.
    std::map<int, std::vector<CopyBlock>> by_device;
    for (const auto& c : job.copies) by_device[c.device].push_back(c.block);
    for (auto& [device, blocks] : by_device) {
      auto s = stream(device, StreamUse::kQueued, job.after_default_stream);
      if (!s.ok()) {
        w.submit_error = s.status();
        break;
      }
      if (job.after) {
        if (Status ordered = job.after->order(device, (*s)->native_stream()); !ordered.ok()) {
          w.submit_error = ordered;
          break;
        }
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
      waiting_count_.fetch_add(1, std::memory_order_release);
    }
    watch_cv_.notify_one();
  }
}

void GpuPath::run(std::function<void()> job) {
  {
    std::lock_guard lock(mu_);
    jobs_.push_back(std::move(job));
  }
  job_cv_.notify_one();
}

// Polls the submitted copies and passes each finished one on. Copies on one
// stream finish in submission order, so a sweep stops asking a stream once
// it reported a copy still running; copies on other streams (the hand-off
// lanes, other devices) are seen as soon as they are done rather than after
// the oldest copy. With only the oldest polled, 8 handed-off 4 KiB writes in
// flight were seen done ~50 us after submission (H100 machine), for copies
// that take a few.
// Back-off, while only queued (large) copies run: yield for 30 us, then
// sleep 2 us doubling to 20 us -- a staging copy takes ~20 us (1 MiB at PCIe
// speed) and the frame waits for it. While a handed-off small copy runs the
// watcher does not sleep: it is due within microseconds.
void GpuPath::watch_loop() {
  t_on_watcher = true;
#ifdef __linux__
  // The naps above are microseconds; the kernel's default timer slack
  // (50 us) would stretch each to ~60.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
  std::deque<Waiting> mine;
  std::vector<const CopyStream*> busy;  // streams seen running in this sweep
  auto idle_since = Clock::now();
  auto nap = std::chrono::microseconds(0);
  // After finishing a handed-off copy the watcher stays awake a while: the
  // next one of a burst of transfers is due within microseconds, and a
  // sleeping watcher took ~60 us to wake for it (H100 machine).
  Clock::time_point linger_until{};
  for (;;) {
    if (mine.empty()) {
      while (waiting_count_.load(std::memory_order_acquire) == 0 && Clock::now() < linger_until) {
        std::this_thread::yield();
      }
    }
    {
      std::unique_lock lock(mu_);
      if (mine.empty()) {
        watch_cv_.wait(lock, [&] { return stop_watch_ || !waiting_.empty(); });
        if (waiting_.empty()) return;
      }
      waiting_count_.store(0, std::memory_order_relaxed);
      while (!waiting_.empty()) {
        mine.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
      }
    }
    size_t finished = 0;
    bool small_running = false;
    busy.clear();
    for (auto it = mine.begin(); it != mine.end();) {
      Waiting& w = *it;
      Status status = w.submit_error;
      bool done = true;
      for (auto& [stream, ticket] : w.tickets) {
        if (!status.ok()) break;
        if (std::find(busy.begin(), busy.end(), stream) != busy.end()) {
          done = false;
          break;
        }
        Status s = stream->poll(ticket);
        if (s.code() == StatusCode::kInProgress) {
          busy.push_back(stream);
          done = false;
          break;
        }
        status = s;
      }
      if (!done) {
        small_running = small_running || w.done_on_watcher;
        ++it;
        continue;
      }
      if (!status.ok()) {
        status = Status(status.code(), "GPU staging copy failed: " + status.message());
      }
      if (w.done_on_watcher) {
        const auto seen = Clock::now();
        w.done(status);
        if (tracing_) trace(w, seen, Clock::now());
        linger_until = Clock::now() + kWatcherLinger;
      } else {
        {
          std::lock_guard lock(mu_);
          finished_.push_back(Finished{std::move(w), std::move(status), Clock::now()});
        }
        callback_cv_.notify_one();
      }
      it = mine.erase(it);
      ++finished;
    }
    if (mine.empty() || finished > 0 || small_running) {
      idle_since = Clock::now();
      nap = std::chrono::microseconds(0);
      if (small_running && finished == 0) std::this_thread::yield();
      continue;
    }
    if (nap.count() == 0) {
      std::this_thread::yield();
      if (Clock::now() - idle_since > std::chrono::microseconds(30)) {
        nap = std::chrono::microseconds(2);
      }
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(20));
    }
  }
}

void GpuPath::callback_loop() {
  for (;;) {
    Finished f;
    if (!take(callback_cv_, finished_, stop_callbacks_, &f)) return;
    f.w.done(f.status);
    if (tracing_) trace(f.w, f.seen, Clock::now());
  }
}

void GpuPath::job_loop() {
  for (;;) {
    std::function<void()> job;
    if (!take(job_cv_, jobs_, stop_, &job)) return;
    job();
  }
}

}  // namespace ferry::staging
