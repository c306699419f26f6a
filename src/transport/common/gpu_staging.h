// GPU memory through pinned staging slots, for transports that move host
// memory only (tcp always; fabric where the provider does not register GPU
// memory, FI_HMEM): device → slot → network, network → slot → device, with
// the copies pipelined against the network. Device→host copies of slot k+1
// run while slot k is on the wire; host→device copies of a received slot run
// while the next one is received. No I/O or progress thread ever waits for a
// copy: completion threads do, then hand the slot (or the acknowledgement)
// back to the transport -- which sends it from that thread (non-blocking).
// Moved here from src/transport/tcp/gpu_path.{h,cc}; the slot size is the
// user's (tcp: its frame payload, part of its protocol).
// Small copies (GpuPathOptions::inline_bytes, 64 KiB) skip all of that: the thread that has
// the frame submits the copy on a stream of their own and spins until it is
// done, then carries on with the frame itself. Each hand-off between threads
// costs a wake-up, and a 4 KiB GPU write across processes paid four of them
// (submit, watcher, callback, on both sides): ~90-100 us per staging copy of
// a copy that takes a few, on an H200 machine (docs/gpu.md). A copy still
// running after GpuPathOptions::inline_wait is handed to the watcher, so a busy GPU
// cannot hold an I/O thread; so is one that follows the previous inline copy
// closely (several transfers in flight), so that posting threads keep posting.
// One watcher thread polls the copies (every stream's oldest running one:
// a stream finishes its copies in order) and hands finished ones to several callback threads, so
// that frames of different streams are sent in parallel, as the I/O threads
// send host-memory frames: with one thread, every GPU read response of a peer
// went out through it (GPU reads at 0.72x host memory at 1 MiB blocks on an
// H100 machine). Only one thread polls: when every completion thread polled
// its own copy, they contended for the copy stream's lock with the submit
// thread. Callbacks may run out of submission order; the data path does not
// depend on their order (responses keep their order through the stream's
// deferred queue, each frame carries its own pending entry).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/default_stream_mark.h"
#include "cuda/staging_pool.h"
#include "ferry/gpu.h"
#include "ferry/status.h"

namespace ferry::staging {

// One copy between a staging slot and GPU memory, on `device`'s stream.
struct DeviceCopy {
  int device;
  CopyBlock block;
};

struct GpuPathOptions {
  size_t staging_bytes = 64 << 20;             // pinned staging, cut into slot_bytes slots
  uint32_t sm_budget = 4;                      // SMs the copy kernel may use
  uint64_t inline_bytes = 64 << 10;            // copies this small run on the caller's thread
  std::chrono::microseconds inline_wait{500};  // then their completion is handed on
  uint64_t slot_bytes = 1 << 20;               // one staging slot (tcp: kGpuFramePayload)
  // The transport using the path ("tcp", "fabric"): named in errors, and the
  // diagnostic environment knobs are FERRY_<USER>_GPU_... (FERRY_TCP_GPU_TRACE).
  std::string user = "tcp";
  // An inline copy that starts within this window of the previous one on its
  // thread is not waited for by that thread: the watcher finishes it and runs
  // `done`. One blocking transfer at a time keeps the spin (no hand-off
  // wake-up in its latency); with several in flight the posting thread spun
  // ~9 us per 4 KiB write on an H100 machine, and that bounded the transfers
  // per second (docs/gpu.md). FERRY_<USER>_GPU_HANDOFF_US (0 = never; for
  // measurement) overrides it; create() refuses a malformed value.
  std::chrono::microseconds handoff_window{20};
};

class GpuPath {
 public:
  // NotSupported (with the reason) without CUDA or a device.
  // Threads are named `thread_prefix`-gpu-... (at most 15 characters kept).
  static Result<std::unique_ptr<GpuPath>> create(const GpuPathOptions& options,
                                                 const std::string& thread_prefix);
  ~GpuPath();

  // A staging slot at once, or null: then `later` gets the next released
  // slot on the job thread (waiters are served in request order). Nothing
  // here blocks, so I/O threads may ask: a transfer larger than the staging
  // pool flows through it instead of stalling the thread that would send
  // the frames which free the slots.
  std::unique_ptr<StagingSlot> slot_or_later(
      std::function<void(std::unique_ptr<StagingSlot>)> later);
  size_t slot_bytes() const { return opt_.slot_bytes; }
  // The pinned memory every slot lies in, for a transport that registers it
  // once with its network (fabric under FI_MR_LOCAL).
  std::pair<uint8_t*, size_t> staging_memory() const;
  // Queues the copies and calls `done` from a completion thread once all of
  // them finished (or with the first error). Returns at once: the submit
  // thread enqueues them on the device's stream, in call order, so the I/O
  // threads never make CUDA calls for large copies (a submission takes
  // ~10-40 us of them). Copies of at most `inline_bytes` in total, all on one
  // device, are submitted here and waited for, and `done` runs on this
  // thread before copy_then returns (unless the wait outlasts `inline_wait`,
  // or the copy came close behind another and was handed to the watcher):
  // callers hold no lock that `done` takes. The copies' memory must stay
  // valid until `done`.
  // `after_default_stream`: the copies start only after work queued on their
  // device's legacy default stream before this call -- for the caller's own
  // memory that the copies read (a write's source), which a PyTorch kernel
  // may still be filling. Never for a target's: a target kernel waiting on
  // the data would hold its own copy back.
  // `after` (a read's landing copy): the copies start only after the work
  // the mark recorded (cuda/default_stream_mark.h); null: no such order.
  void copy_then(std::vector<DeviceCopy> copies, std::function<void(Status)> done,
                 bool after_default_stream = false,
                 std::shared_ptr<const DefaultStreamMark> after = nullptr);
  // Several frames' copies: `done[k]` runs once groups[k] finished. Where
  // every group is small enough for the inline path (and all are on one
  // device), all are submitted before the first is waited for, so the first
  // frame goes out while the later copies still run; otherwise each group
  // goes through copy_then.
  void copy_each_then(std::vector<std::vector<DeviceCopy>> groups,
                      std::vector<std::function<void(Status)>> done,
                      bool after_default_stream = false);
  // True on the watcher thread: a `done` run there (a handed-off copy) should
  // hand long work, such as a send, on to another thread.
  static bool on_watcher();
  // Runs `job` on the job thread, in submission order.
  void run(std::function<void()> job);

 private:
  GpuPath(std::unique_ptr<StagingPool> pool, const GpuPathOptions& options,
          const std::string& thread_prefix);
  // Which of a device's streams: queued copies, or copies waited for by
  // their caller (which so never queue behind a large copy), or
  // (kInlineEngine) a lone inline copy on the copy engine: cudaMemcpyAsync
  // takes any memory as it is, where the copy kernel first asks the driver
  // what both pointers are and then pays a launch (~2-4 us more for one
  // 4 KiB block, ferry-latency-floor). Each use has a twin ordered after the
  // legacy default stream: without it, the copy engine read a write's source
  // before the default stream had filled it (docs/gpu.md, "A lone inline
  // copy on the copy engine").
  enum class StreamUse : uint8_t { kQueued, kInline, kInlineEngine };
  Result<CopyStream*> stream(int device, StreamUse use, bool after_default_stream,
                             bool handed_off = false);
  // The inline path of copy_then; false if the copies are not for it.
  bool copy_inline(std::vector<DeviceCopy>& copies, std::function<void(Status)>& done,
                   bool after_default_stream, const DefaultStreamMark* after);
  // Its steps: small enough and on one device; submitted on the calling
  // thread's stream (false: no stream); waited for (spinning), or handed to
  // the watcher when `hand_off` or the wait outlasts inline_wait.
  struct InlineCopy;
  bool inline_eligible(const std::vector<DeviceCopy>& copies) const;
  bool submit_inline(const std::vector<DeviceCopy>& copies, bool after_default_stream,
                     bool hand_off, InlineCopy* out, const DefaultStreamMark* after = nullptr);
  void finish_inline(InlineCopy& c, std::function<void(Status)>& done, bool hand_off);
  // Waits on `cv` for an item of `queue` (guarded by mu_) and moves it to
  // `out`; false once `stop` is set and the queue is drained.
  template <typename T>
  bool take(std::condition_variable& cv, std::deque<T>& queue, const bool& stop, T* out);
  void watch_loop();
  void callback_loop();
  void job_loop();
  void submit_loop();

  using Clock = std::chrono::steady_clock;
  struct Submit {
    std::vector<DeviceCopy> copies;
    std::function<void(Status)> done;
    Clock::time_point queued;
    bool after_default_stream = false;
    std::shared_ptr<const DefaultStreamMark> after;
  };
  struct Waiting {
    std::vector<std::pair<CopyStream*, uint64_t>> tickets;
    Status submit_error;
    std::function<void(Status)> done;
    Clock::time_point queued, submit_begin, submit_end;
    bool done_on_watcher = false;  // a small copy handed off by copy_inline
  };
  struct InlineCopy {
    Waiting w;
    CopyStream* stream = nullptr;
    Result<uint64_t> ticket = err::Internal("not submitted");
  };
  struct Finished {
    Waiting w;
    Status status;
    Clock::time_point seen;
  };
  // FERRY_<USER>_GPU_TRACE=1 (FERRY_TCP_GPU_TRACE): per frame, microseconds queued for the submit
  // thread, inside submit, until the copy was seen done, inside the callback;
  // summarized on stderr when the path is destroyed (diagnostic).
  void trace(const Waiting& w, Clock::time_point seen, Clock::time_point returned);
  bool tracing_ = false;
  // A lone inline copy goes to the copy engine (StreamUse::kInlineEngine);
  // FERRY_<USER>_GPU_INLINE_ENGINE=0 (measurement only) sends it to the kernel.
  bool inline_engine_ = true;
  std::chrono::microseconds handoff_window_{20};  // GpuPathOptions::handoff_window
  std::mutex trace_mu_;
  std::vector<std::array<float, 4>> trace_;

  const char* env(const char* knob) const;  // FERRY_<USER>_GPU_<knob>, or null
  static std::string env_name(const std::string& user, const char* knob);

  std::unique_ptr<StagingPool> pool_;
  GpuPathOptions opt_;
  std::mutex streams_mu_;
  // (device, use, after the default stream, lane) →. Inline copies use the
  // calling thread's lane (inline_lane()), handed-off ones the next of the
  // hand-off lanes, queued ones lane 0.
  std::map<std::tuple<int, StreamUse, bool, uint32_t>, std::unique_ptr<CopyStream>> streams_;

  // One lock, a condition variable per kind of thread (a shared one, with
  // notify_all, woke all six threads for every frame).
  std::mutex mu_;
  std::condition_variable submit_cv_, job_cv_, watch_cv_, callback_cv_;
  std::deque<Submit> submits_;
  std::deque<std::function<void()>> jobs_;
  std::deque<Waiting> waiting_;           // submitted, for the watcher
  std::atomic<size_t> waiting_count_{0};  // pushed to waiting_ since the watcher last took
  std::deque<Finished> finished_;         // for the callback threads
  bool stop_ = false;                     // job and submit threads: drain, then exit
  bool stop_watch_ = false;               // watcher: drain, then exit
  bool stop_callbacks_ = false;           // callback threads: drain, then exit
  std::thread watch_thread_;
  std::vector<std::thread> callback_threads_;
  std::thread job_thread_;
  std::thread submit_thread_;
};

}  // namespace ferry::staging
