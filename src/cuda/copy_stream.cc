// CopyStream: routes each block of a batch to the SM gather kernel (small
// blocks, device-accessible memory) or the copy engine (large blocks, peer
// GPUs, pageable host memory), enqueues both on one ordered stream and hands
// out tickets that complete in submission order.
//
// Kernel descriptors are written straight into a mapped pinned staging buffer
// that the kernel reads (no separate descriptor upload). A large batch is
// launched in geometrically growing slices while the host still classifies
// the rest, so the GPU starts within microseconds instead of after the whole
// batch has been walked, and -- the slices growing by less than the GPU's
// time per block over the host's -- never waits for the host after that.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cuda/batch_api.h"
#include "cuda/copy_stream_knobs.h"
#include "cuda/cuda_detect.h"
#include "cuda/cuda_util.h"
#include "cuda/gather_kernel.h"
#include "cuda/resident_copier.h"
#include "ferry/gpu.h"

namespace ferry {
namespace {

using cuda::AfterDefault;
using cuda::CopyDesc;
using cuda::cuda_status;
using cuda::Knobs;

// Kernel work item: larger kernel-path blocks are split so that warps share
// the work of a few big blocks.
constexpr uint64_t kChunk = 16 * 1024;
// Batches up to this many blocks are scanned once before anything is
// enqueued, to learn whether they mix both paths (the copy engine then runs
// on a forked stream). Larger ones skip the scan -- it would delay the first
// launch by ~0.4 ns per block -- and always fork.
constexpr size_t kPrescanMax = 4096;
// Each launch's descriptors start on a fresh 384-byte (3 x 128 B) boundary,
// so the host never writes a cache line that an earlier, running kernel reads.
constexpr size_t kDescAlign = 16;
// Submissions in flight before submit() waits for the oldest.
constexpr size_t kMaxPending = 1024;

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

// What the kernel path needs to know about one allocation.
struct Span {
  uint64_t lo = 0, hi = 0;  // [lo, hi) host/UVA addresses; hi == 0: unknown extent
  CudaMemoryType type = CudaMemoryType::kPageableHost;
  int device = -1;
  int64_t delta = 0;  // device address - host address (0 under UVA)
  bool mapped = true;
};

// Per-submit cache of pointer classifications: within one call the caller's
// buffers cannot change, so one driver query per allocation suffices.
class Classifier {
 public:
  // Returns the span containing [p, p+n) or an error naming why not. `side`
  // (0 dst, 1 src) keeps one most-recent span per side: an H2D batch
  // alternates between two allocations.
  Result<const Span*> find(const void* p, uint64_t n, int side) {
    const uint64_t a = reinterpret_cast<uint64_t>(p);
    const Span*& mru = mru_[side];
    if (mru != nullptr && a >= mru->lo && a + n <= mru->hi) return mru;
    auto it = spans_.upper_bound(a);
    if (it != spans_.begin()) {
      --it;
      if (a >= it->second.lo && a < it->second.hi) {
        mru = &it->second;
        return mru;
      }
    }
    Result<CudaPointerInfo> r = cuda_pointer_info(p);
    if (!r.ok()) return r.status();
    Span s;
    s.type = r->type;
    s.device = r->device;
    s.mapped = r->type == CudaMemoryType::kPageableHost || r->device_address != 0;
    s.delta = r->device_address != 0 ? static_cast<int64_t>(r->device_address - a) : 0;
    if (r->size != 0) {
      s.lo = r->base;
      s.hi = r->base + r->size;
      mru = &spans_.emplace(s.lo, s).first->second;
      return mru;
    }
    // Extent unknown (pageable memory, or no driver entry point): not cached.
    scratch_ = s;
    scratch_.lo = a;
    scratch_.hi = a + n;
    return &scratch_;
  }

 private:
  std::map<uint64_t, Span> spans_;  // node-based: pointers stay valid
  const Span* mru_[2] = {nullptr, nullptr};
  Span scratch_;
};

struct Staging {
  CopyDesc* host = nullptr;
  CopyDesc* dev = nullptr;
  size_t cap = 0;
};

}  // namespace

struct CopyStream::Impl {
  int device = 0;
  CopyOptions opts;
  Knobs knobs;
  uint32_t sm_count = 0;
  cudaStream_t stream = nullptr;     // the ordered stream; tickets live here
  cudaStream_t ce_stream = nullptr;  // copy-engine half of a mixed batch
  cudaEvent_t fork_ev = nullptr, join_ev = nullptr;
  cudaEvent_t legacy_ev = nullptr;  // after_default_stream: the legacy stream's work so far
  uint32_t* sm_mask = nullptr;      // device: SMs the kernel ran on

  mutable std::mutex mu;
  uint64_t last_ticket = 0;
  uint64_t done_through = 0;
  Status failed;  // sticky once the stream reports an error

  struct Pending {
    uint64_t ticket;
    cudaEvent_t ev;                // null for a copy of the resident kernel
    std::vector<Staging> staging;  // descriptor buffers the batch's kernels read
    uint64_t resident = 0;         // the resident copier's ticket, or 0
    CopyBlock block{};             // a resident copy (sent again if it is deferred)
  };
  std::deque<Pending> pending;
  size_t resident_pending = 0;  // entries of `pending` the resident kernel runs
  std::unique_ptr<cuda::ResidentCopier> resident;
  bool resident_unavailable = false;  // creating it failed once: not asked again
  std::vector<cudaEvent_t> free_events;
  std::vector<Staging> free_staging;
  CopyStreamStats st;

  std::vector<void*> ce_dst;
  std::vector<const void*> ce_src;
  std::vector<size_t> ce_size;

  ~Impl() {
    cuda::DeviceGuard g(device);
    if (resident != nullptr) {
      (void)drain_resident();  // postings it has not taken yet run too
      resident.reset();        // then its kernel leaves
    }
    if (stream != nullptr) cudaStreamSynchronize(stream);
    if (ce_stream != nullptr) cudaStreamSynchronize(ce_stream);
    for (auto& p : pending) {
      if (p.ev != nullptr) cudaEventDestroy(p.ev);
      for (auto& s : p.staging) cudaFreeHost(s.host);
    }
    for (auto e : free_events) cudaEventDestroy(e);
    for (auto& s : free_staging) cudaFreeHost(s.host);
    if (fork_ev != nullptr) cudaEventDestroy(fork_ev);
    if (join_ev != nullptr) cudaEventDestroy(join_ev);
    if (legacy_ev != nullptr) cudaEventDestroy(legacy_ev);
    if (sm_mask != nullptr) cudaFree(sm_mask);
    if (ce_stream != nullptr) cudaStreamDestroy(ce_stream);
    if (stream != nullptr) cudaStreamDestroy(stream);
    cudaGetLastError();
  }

  Status init() {
    cuda::DeviceGuard g(device);
    if (g.status() != cudaSuccess) return cuda_status(g.status(), "cudaSetDevice");
    int n = 0;
    cudaError_t e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return cuda_status(e, "cudaDeviceGetAttribute(MultiProcessorCount)");
    sm_count = static_cast<uint32_t>(n);
    // after_default_stream: a blocking stream, tied to the legacy stream by
    // the driver; or (FERRY_COPY_AFTER_DEFAULT=query|event) a non-blocking one
    // that submit() orders after the legacy stream itself.
    const unsigned flags =
        opts.after_default_stream && knobs.after_default == AfterDefault::kBlocking
            ? cudaStreamDefault
            : cudaStreamNonBlocking;
    if ((e = cudaStreamCreateWithFlags(&stream, flags)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&ce_stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&fork_ev, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&join_ev, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&legacy_ev, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaMalloc(reinterpret_cast<void**>(&sm_mask), 8 * sizeof(uint32_t))) != cudaSuccess ||
        (e = cudaMemsetAsync(sm_mask, 0, 8 * sizeof(uint32_t), stream)) != cudaSuccess) {
      return cuda_status(e, "creating the copy stream");
    }
    return Status::Ok();
  }

  // Retires finished submissions in order. Caller holds mu.
  Status retire() {
    if (!failed.ok()) return failed;
    while (!pending.empty()) {
      Pending& p = pending.front();
      if (p.resident != 0) {
        Result<cuda::ResidentCopier::State> rs = resident->state(p.resident);
        if (!rs.ok()) {
          failed = rs.status();
          return failed;
        }
        if (*rs == cuda::ResidentCopier::State::kPending) break;
        if (*rs == cuda::ResidentCopier::State::kDeferred) {
          if (Status s = send_deferred(p); !s.ok()) {
            failed = s;
            return failed;
          }
          continue;  // now an ordinary entry
        }
        done_through = p.ticket;
        --resident_pending;
        pending.pop_front();
        continue;
      }
      cudaError_t e = cudaEventQuery(p.ev);
      if (e == cudaErrorNotReady) break;
      if (e != cudaSuccess) {
        cudaGetLastError();
        Status s = cuda_status(e, "copy stream");
        failed = err::Internal("copy stream on device " + std::to_string(device) +
                               " failed while running ticket " + std::to_string(p.ticket) + ": " +
                               s.message());
        return failed;
      }
      done_through = p.ticket;
      free_events.push_back(p.ev);
      for (auto& s : p.staging) release_staging(s);
      pending.pop_front();
    }
    return Status::Ok();
  }

  void release_staging(Staging s) {
    if (free_staging.size() < 8) {
      free_staging.push_back(s);
    } else {
      cudaFreeHost(s.host);
    }
  }

  Result<Staging> acquire_staging(size_t n) {
    // Best fit among the free buffers.
    auto best = free_staging.end();
    for (auto it = free_staging.begin(); it != free_staging.end(); ++it) {
      if (it->cap >= n && (best == free_staging.end() || it->cap < best->cap)) best = it;
    }
    if (best != free_staging.end()) {
      Staging s = *best;
      free_staging.erase(best);
      return s;
    }
    Staging s;
    s.cap = std::bit_ceil(std::max<size_t>(n, 4096));
    void* h = nullptr;
    cudaError_t e =
        cudaHostAlloc(&h, s.cap * sizeof(CopyDesc), cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return cuda_status(e, "cudaHostAlloc (descriptor staging)");
    }
    void* d = nullptr;
    if ((e = cudaHostGetDevicePointer(&d, h, 0)) != cudaSuccess) {
      cudaGetLastError();
      cudaFreeHost(h);
      return cuda_status(e, "cudaHostGetDevicePointer (descriptor staging)");
    }
    s.host = static_cast<CopyDesc*>(h);
    s.dev = static_cast<CopyDesc*>(d);
    return s;
  }

  Result<cudaEvent_t> acquire_event() {
    if (!free_events.empty()) {
      cudaEvent_t e = free_events.back();
      free_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (r != cudaSuccess) return cuda_status(r, "cudaEventCreate");
    return e;
  }

  // A resident copy whose gate stayed shut: the same copy down the ordinary
  // stream, after the legacy default stream as that orders it.
  Status send_deferred(Pending& p) {
    if (opts.after_default_stream && knobs.after_default != AfterDefault::kBlocking) {
      cudaError_t e = cudaEventRecord(legacy_ev, cudaStreamLegacy);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, legacy_ev, 0);
      if (e != cudaSuccess) return cuda_status(e, "ordering a deferred copy");
    }
    Result<cudaEvent_t> ev = acquire_event();
    if (!ev.ok()) return ev.status();
    cudaError_t e =
        cudaMemcpyAsync(p.block.dst, p.block.src, p.block.size, cudaMemcpyDefault, stream);
    if (e == cudaSuccess) e = cudaEventRecord(ev.value(), stream);
    if (e != cudaSuccess) {
      free_events.push_back(ev.value());
      return cuda_status(e, "sending a deferred copy to the copy engine");
    }
    p.ev = ev.value();
    p.resident = 0;
    --resident_pending;
    ++st.resident_deferred;
    return Status::Ok();
  }

  // A lone small block of device memory, when nothing but resident copies is
  // in flight (so stream order holds): to the resident kernel. 0 when it
  // does not take the block.
  Result<uint64_t> try_resident(std::span<const CopyBlock> blocks, const CopyOptions& o,
                                BlockCheck check) {
    if (o.resident_max_block == 0 || resident_unavailable || blocks.size() != 1 ||
        check != BlockCheck::kDeviceMemory || resident_pending != pending.size()) {
      return uint64_t{0};
    }
    const CopyBlock& b = blocks[0];
    if (b.size == 0 || b.size > o.resident_max_block || b.dst == nullptr || b.src == nullptr ||
        ((reinterpret_cast<uintptr_t>(b.dst) | reinterpret_cast<uintptr_t>(b.src)) & 15) != 0) {
      return uint64_t{0};
    }
    if (resident == nullptr) {
      cuda::ResidentCopier::Options ro;
      ro.linger = std::chrono::microseconds(o.resident_linger_us);
      ro.query_default_stream = !knobs.resident_gate_always;
      auto r = cuda::ResidentCopier::create(device, ro);
      if (!r.ok()) {
        resident_unavailable = true;
        return uint64_t{0};
      }
      resident = std::move(r).value();
    }
    Result<uint64_t> rt = resident->post(b.dst, b.src, b.size, o.after_default_stream);
    if (!rt.ok()) return rt.status();
    if (*rt == 0) return uint64_t{0};
    const uint64_t ticket = ++last_ticket;
    pending.push_back(Pending{ticket, nullptr, {}, *rt, b});
    ++resident_pending;
    ++st.batches;
    ++st.resident_blocks;
    return ticket;
  }

  // Before a batch goes down the stream: the resident copies in flight
  // finish first (stream order; they are small and take microseconds).
  Status drain_resident() {
    const auto start = std::chrono::steady_clock::now();
    while (resident_pending > 0) {
      if (Status s = retire(); !s.ok()) return s;
      if (resident_pending == 0) break;
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(10)) {
        return err::Internal("copy stream on device " + std::to_string(device) + ": " +
                             std::to_string(resident_pending) +
                             " resident copies not done after 10 s");
      }
      std::this_thread::yield();
    }
    return Status::Ok();
  }

  // After a failure mid-batch: let what was already enqueued finish, so no
  // copy of a rejected batch still runs when submit() returns.
  Status abandon(Status why) {
    cudaStreamSynchronize(stream);
    cudaStreamSynchronize(ce_stream);
    cudaGetLastError();
    return why;
  }

  Result<uint64_t> submit(std::span<const CopyBlock> blocks, const CopyOptions& o,
                          BlockCheck check = BlockCheck::kClassify);
};

Result<uint64_t> CopyStream::Impl::submit(std::span<const CopyBlock> blocks, const CopyOptions& o,
                                          BlockCheck check) {
  std::lock_guard<std::mutex> lock(mu);
  cuda::DeviceGuard g(device);
  if (g.status() != cudaSuccess) return cuda_status(g.status(), "cudaSetDevice");
  if (Status s = retire(); !s.ok()) return s;
  while (pending.size() >= kMaxPending) {  // back-pressure
    if (pending.front().ev != nullptr) {
      cudaEventSynchronize(pending.front().ev);
    } else {
      std::this_thread::yield();
    }
    if (Status s = retire(); !s.ok()) return s;
  }
  if (Result<uint64_t> t = try_resident(blocks, o, check); !t.ok() || *t != 0) return t;
  if (Status s = drain_resident(); !s.ok()) return s;

  if (o.after_default_stream && knobs.after_default != AfterDefault::kBlocking) {
    // Work queued on the legacy default stream before this call runs first:
    // an event recorded there that this stream waits for -- with `query`,
    // only when the legacy stream is busy (an idle one costs one query).
    const bool busy = knobs.after_default == AfterDefault::kEvent ||
                      cudaStreamQuery(cudaStreamLegacy) != cudaSuccess;
    if (busy) {
      cudaGetLastError();
      cudaError_t e = cudaEventRecord(legacy_ev, cudaStreamLegacy);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, legacy_ev, 0);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return cuda_status(e, "ordering after the legacy default stream");
      }
    }
  }

  const uint32_t budget = std::min(o.sm_budget, sm_count);
  const uint64_t kmax = budget == 0 ? 0 : o.kernel_max_block;
  // Does the batch mix both paths? Then the copy engine runs on its own
  // stream, concurrently with the kernel. Small batches are scanned (sizes
  // only); large ones, where a scan would delay the first launch, always
  // fork when the kernel may be used.
  bool fork = false;
  size_t first_estimate = 0;  // descriptors, to size the first staging buffer
  if (kmax > 0 && blocks.size() <= kPrescanMax) {
    bool any_ce = false;
    for (const CopyBlock& b : blocks) {
      if (b.size == 0) continue;
      if (b.size < kmax) {
        first_estimate += (b.size + kChunk - 1) / kChunk;
      } else {
        any_ce = true;
      }
    }
    fork = any_ce && first_estimate > 0;
  } else if (kmax > 0) {
    fork = true;
    first_estimate = blocks.size();  // exact when every block is at most kChunk
  }

  // Descriptor staging: one buffer normally; when a batch has more
  // descriptors than estimated, the pending ones are launched and a further
  // buffer is taken. `staging` is the one being filled, `filled` the earlier
  // ones (still read by launched kernels).
  Staging staging;
  std::vector<Staging> filled;
  // Returns the staging buffers on every early exit below.
  struct StagingReturn {
    Impl* self;
    Staging* s;
    std::vector<Staging>* f;
    ~StagingReturn() {
      if (s->host != nullptr) self->release_staging(*s);
      for (auto& x : *f) self->release_staging(x);
    }
  } staging_return{this, &staging, &filled};

  if (fork) {
    cudaError_t e = cudaEventRecord(fork_ev, stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(ce_stream, fork_ev, 0);
    if (e != cudaSuccess) return cuda_status(e, "forking the copy-engine stream");
  }

  ce_dst.clear();
  ce_src.clear();
  ce_size.clear();
  Classifier cls;
  size_t nd = 0;        // descriptors written into `staging`
  size_t launched = 0;  // of those, already launched
  size_t slice = knobs.first_slice;
  uint64_t kernel_blocks = 0;
  uint64_t launches = 0;
  uint64_t ce_tick = 0;
  uint32_t max_ctas = 0;
  size_t blocks_left = blocks.size();

  auto launch_pending = [&]() -> Status {
    if (nd == launched) return Status::Ok();
    uint32_t ctas = 0;
    cudaError_t e = cuda::launch_gather(staging.host + launched, staging.dev + launched,
                                        static_cast<uint32_t>(nd - launched), budget, knobs.gather,
                                        sm_mask, stream, &ctas);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return cuda_status(e, "launching the gather kernel");
    }
    // The next launch starts on a fresh 384-byte boundary (see kDescAlign).
    nd = std::min((nd + kDescAlign - 1) / kDescAlign * kDescAlign, staging.cap);
    launched = nd;
    ++launches;
    max_ctas = std::max(max_ctas, ctas);
    return Status::Ok();
  };
  // Makes room for `need` more descriptors in `staging`.
  auto reserve = [&](size_t need) -> Status {
    if (staging.host != nullptr && nd + need <= staging.cap) return Status::Ok();
    if (Status s = launch_pending(); !s.ok()) return s;
    if (staging.host != nullptr) filled.push_back(staging);
    staging = Staging{};
    // Room for the rest of the batch at one descriptor per block, the
    // alignment padding of every launch, and at least this block.
    const size_t want = std::max(first_estimate > 0 ? first_estimate : blocks_left, need) +
                        kDescAlign * (24 + blocks_left / std::max<size_t>(knobs.max_slice, 1));
    first_estimate = 0;
    Result<Staging> r = acquire_staging(want);
    if (!r.ok()) return r.status();
    staging = r.value();
    nd = launched = 0;
    return Status::Ok();
  };

  for (size_t i = 0; i < blocks.size(); ++i, --blocks_left) {
    const CopyBlock& b = blocks[i];
    if (b.size == 0) continue;
    if (b.dst == nullptr || b.src == nullptr) {
      return abandon(err::InvalidArgument("block " + std::to_string(i) + ": null " +
                                          (b.dst == nullptr ? "dst" : "src") + " pointer (size " +
                                          std::to_string(b.size) + ")"));
    }
    bool to_kernel = b.size < kmax;
    if (to_kernel && knobs.ce_every != 0 && ++ce_tick % knobs.ce_every == 0) to_kernel = false;
    uint64_t dst_dev = 0, src_dev = 0;
    bool src_host = false;
    if (to_kernel && check == BlockCheck::kDeviceMemory) {
      // The caller vouches: device memory of this GPU (or mapped into it),
      // whose UVA address is the device address.
      dst_dev = reinterpret_cast<uint64_t>(b.dst);
      src_dev = reinterpret_cast<uint64_t>(b.src);
    } else if (to_kernel) {
      for (int side = 0; side < 2 && to_kernel; ++side) {
        const void* p = side == 0 ? static_cast<const void*>(b.dst) : b.src;
        const char* name = side == 0 ? "dst" : "src";
        Result<const Span*> r = cls.find(p, b.size, side);
        if (!r.ok()) {
          return abandon(Status(r.status().code(), "block " + std::to_string(i) + ": " + name +
                                                       " " + hex(p) + ": " + r.status().message()));
        }
        const Span& s = *r.value();
        const uint64_t a = reinterpret_cast<uint64_t>(p);
        const bool other_gpu = s.type != CudaMemoryType::kPinnedHost &&
                               s.type != CudaMemoryType::kPageableHost &&
                               s.type != CudaMemoryType::kManaged && s.device != device;
        if (other_gpu) {
          // Peer GPU memory: the copy engine reaches it without peer mappings
          // (without peer access its device pointer here is NULL, which is not
          // "unmapped host memory"). Checked first for that reason.
          to_kernel = false;
          continue;
        }
        if (s.type == CudaMemoryType::kPageableHost || !s.mapped) {
          return abandon(err::InvalidArgument(
              "block " + std::to_string(i) + ": " + name + " " + hex(p) + " is " +
              (s.mapped ? "pageable host memory" : "pinned host memory not mapped for the GPU") +
              "; blocks below kernel_max_block (" + std::to_string(kmax) +
              " bytes) go through the SM copy kernel, which needs pinned, mapped memory "
              "(cudaHostAlloc or cudaHostRegister); or set sm_budget=0 to use the copy engine"));
        }
        if (s.hi != 0 && a + b.size > s.hi) {
          return abandon(
              err::OutOfRange("block " + std::to_string(i) + ": " + name + " [" + hex(p) + ", +" +
                              std::to_string(b.size) + ") runs past the end of its " +
                              std::string(cuda_memory_type_name(s.type)) + " allocation (ends at " +
                              hex(reinterpret_cast<const void*>(s.hi)) + ")"));
        }
        (side == 0 ? dst_dev : src_dev) = static_cast<uint64_t>(static_cast<int64_t>(a) + s.delta);
        if (side == 1) src_host = s.type == CudaMemoryType::kPinnedHost;
      }
    }
    if (!to_kernel) {
      ce_dst.push_back(b.dst);
      ce_src.push_back(b.src);
      ce_size.push_back(b.size);
      continue;
    }
    const size_t need = (b.size + kChunk - 1) / kChunk;
    if (Status s = reserve(need); !s.ok()) return abandon(s);
    ++kernel_blocks;
    const uint64_t flag = src_host ? cuda::kSrcIsHost : 0;
    for (uint64_t off = 0; off < b.size; off += kChunk) {
      staging.host[nd++] =
          CopyDesc{dst_dev + off, src_dev + off, std::min(kChunk, b.size - off) | flag};
    }
    if (nd - launched >= slice) {
      if (Status s = launch_pending(); !s.ok()) return abandon(s);
      slice = std::min<size_t>(slice * knobs.slice_growth, knobs.max_slice);
    }
  }
  if (Status s = launch_pending(); !s.ok()) return abandon(s);

  if (!ce_size.empty()) {
    cudaStream_t cs = fork ? ce_stream : stream;
    Status s = cuda::memcpy_batch(ce_dst.data(), ce_src.data(), ce_size.data(), ce_size.size(),
                                  o.use_batch_api, cs);
    if (!s.ok()) return abandon(s);
  }
  if (fork) {
    cudaError_t e = cudaEventRecord(join_ev, ce_stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, join_ev, 0);
    if (e != cudaSuccess) return abandon(cuda_status(e, "joining the copy-engine stream"));
  }

  Result<cudaEvent_t> ev = acquire_event();
  if (!ev.ok()) return abandon(ev.status());
  if (cudaError_t e = cudaEventRecord(ev.value(), stream); e != cudaSuccess) {
    free_events.push_back(ev.value());
    return abandon(cuda_status(e, "cudaEventRecord"));
  }
  const uint64_t ticket = ++last_ticket;
  // The staging buffers now belong to the pending entry (returned once the
  // ticket completes); an unused one goes back to the free list at once.
  if (staging.host != nullptr && nd > 0) {
    filled.push_back(staging);
    staging = Staging{};
  }
  pending.push_back(Pending{ticket, ev.value(), std::move(filled)});
  filled.clear();
  ++st.batches;
  st.kernel_blocks += kernel_blocks;
  st.engine_blocks += ce_size.size();
  st.kernel_launches += launches;
  st.max_ctas = std::max(st.max_ctas, max_ctas);
  return ticket;
}

// ---- CopyStream ------------------------------------------------------------

CopyStream::CopyStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CopyStream::~CopyStream() = default;

Result<std::unique_ptr<CopyStream>> CopyStream::create(int device, CopyOptions options) {
  std::string reason;
  if (!cuda_available(&reason)) return err::NotSupported(reason);
  const int n = cuda_device_count();
  if (device < 0 || device >= n) {
    return err::InvalidArgument("CUDA device " + std::to_string(device) + " out of range (" +
                                std::to_string(n) + " device(s) visible)");
  }
  Result<Knobs> knobs = cuda::read_knobs();
  if (!knobs.ok()) return knobs.status();
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  impl->opts = options;
  impl->knobs = knobs.value();
  if (Status s = impl->init(); !s.ok()) return s;
  return std::unique_ptr<CopyStream>(new CopyStream(std::move(impl)));
}

Result<uint64_t> CopyStream::submit(std::span<const CopyBlock> blocks, BlockCheck check) {
  return impl_->submit(blocks, impl_->opts, check);
}

Status CopyStream::poll(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (ticket == 0 || ticket > impl_->last_ticket) {
    return err::InvalidArgument("unknown copy ticket " + std::to_string(ticket) +
                                " (last issued: " + std::to_string(impl_->last_ticket) + ")");
  }
  if (ticket <= impl_->done_through) return Status::Ok();
  cuda::DeviceGuard g(impl_->device);
  if (Status s = impl_->retire(); !s.ok()) return s;
  if (ticket <= impl_->done_through) return Status::Ok();
  return Status(StatusCode::kInProgress, "");
}

Status CopyStream::wait(uint64_t ticket, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const bool forever = timeout.count() < 0 || timeout > std::chrono::hours(24 * 365);
  for (;;) {
    Status s = poll(ticket);
    if (s.code() != StatusCode::kInProgress) return s;
    const auto waited = Clock::now() - start;
    if (!forever && waited >= timeout) {
      return err::Timeout("copy ticket " + std::to_string(ticket) + " not done after " +
                          std::to_string(timeout.count()) + " ms (done through " +
                          std::to_string(completed_through()) + "); the copy goes on");
    }
    // Spin briefly (copies often finish in microseconds), then nap 1/64 of
    // the time waited so far (10 us to 500 us), so a wait overshoots the
    // copy's end by a small share of it. Naps doubling to 500 us overshot
    // 5 ms batches: bench/python_gpu_copy.py, 4 KiB H2D, 0.79 -> 0.84-0.85.
    if (waited <= std::chrono::microseconds(50)) {
      std::this_thread::yield();
    } else {
      const auto nap =
          std::clamp(std::chrono::duration_cast<std::chrono::microseconds>(waited) / 64,
                     std::chrono::microseconds(10), std::chrono::microseconds(500));
      std::this_thread::sleep_for(nap);
    }
  }
}

uint64_t CopyStream::completed_through() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  cuda::DeviceGuard g(impl_->device);
  (void)impl_->retire();
  return impl_->done_through;
}

uint64_t CopyStream::last_submitted() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->last_ticket;
}

int CopyStream::device() const {
  return impl_->device;
}
const CopyOptions& CopyStream::options() const {
  return impl_->opts;
}
void* CopyStream::native_stream() const {
  return impl_->stream;
}

CopyStreamStats CopyStream::stats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  CopyStreamStats s = impl_->st;
  cuda::DeviceGuard g(impl_->device);
  uint32_t mask[8] = {};
  if (cudaMemcpyAsync(mask, impl_->sm_mask, sizeof mask, cudaMemcpyDeviceToHost, impl_->stream) ==
          cudaSuccess &&
      cudaStreamSynchronize(impl_->stream) == cudaSuccess) {
    for (uint32_t w : mask) s.sms_used += static_cast<uint32_t>(std::popcount(w));
  } else {
    cudaGetLastError();
  }
  return s;
}

Status copy_blocks(std::span<const CopyBlock> blocks, const CopyOptions& options, int device) {
  std::string reason;
  if (!cuda_available(&reason)) return err::NotSupported(reason);
  if (device < 0 || device >= cuda_device_count()) {
    return err::InvalidArgument("CUDA device " + std::to_string(device) + " out of range (" +
                                std::to_string(cuda_device_count()) + " device(s) visible)");
  }
  // One shared stream per device, created on first use and never destroyed
  // (destroying it during static teardown would race the CUDA runtime's own).
  static std::mutex mu;
  static std::vector<CopyStream*> streams;
  CopyStream* cs = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (streams.size() <= static_cast<size_t>(device)) streams.resize(device + 1, nullptr);
    if (streams[device] == nullptr) {
      Result<std::unique_ptr<CopyStream>> r = CopyStream::create(device, options);
      if (!r.ok()) return r.status();
      streams[device] = std::move(r).value().release();
    }
    cs = streams[device];
  }
  Result<uint64_t> t = cs->impl_->submit(blocks, options);
  if (!t.ok()) return t.status();
  return cs->wait(t.value(), std::chrono::milliseconds(-1));
}

}  // namespace ferry
