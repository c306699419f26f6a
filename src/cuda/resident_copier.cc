// ResidentCopier (see resident_copier.h).
#include "cuda/resident_copier.h"

#include <cuda.h>
#include <emmintrin.h>

#include <atomic>
#include <cstring>
#include <string>

#include "cuda/cuda_util.h"

namespace ferry::cuda {
namespace {

using WriteValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

// cuStreamWriteValue64 (stream memory operations, on by default since CUDA
// 12), or null.
void* write_value_entry() {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t e =
      cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &p, 12000, cudaEnableDefault, &q);
#else
  cudaError_t e = cudaGetDriverEntryPoint("cuStreamWriteValue64", &p, cudaEnableDefault, &q);
#endif
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

uint64_t load_volatile(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

void store_volatile(uint64_t* p, uint64_t v) {
  *reinterpret_cast<volatile uint64_t*>(p) = v;
}

// One 16-byte store: the kernel reads each half with one 16-byte load.
void store_half(uint64_t* at, uint64_t value, uint64_t ticket) {
  _mm_store_si128(reinterpret_cast<__m128i*>(at),
                  _mm_set_epi64x(static_cast<long long>(ticket), static_cast<long long>(value)));
}

}  // namespace

Result<std::unique_ptr<ResidentCopier>> ResidentCopier::create(int device, Options options) {
  DeviceGuard g(device);
  if (g.status() != cudaSuccess) return cuda_status(g.status(), "cudaSetDevice");
  std::unique_ptr<ResidentCopier> c(new ResidentCopier());
  c->device_ = device;
  c->opt_ = options;
  void* host = nullptr;
  cudaError_t e =
      cudaHostAlloc(&host, sizeof(ResidentShared), cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "cudaHostAlloc (resident copier ring)");
  }
  std::memset(host, 0, sizeof(ResidentShared));
  c->shared_ = static_cast<ResidentShared*>(host);
  void* dev = nullptr;
  int least = 0, greatest = 0;
  if ((e = cudaHostGetDevicePointer(&dev, host, 0)) != cudaSuccess ||
      (e = cudaMalloc(reinterpret_cast<void**>(&c->gate_), sizeof(uint64_t))) != cudaSuccess ||
      (e = cudaMemset(c->gate_, 0, sizeof(uint64_t))) != cudaSuccess ||
      (e = cudaDeviceGetStreamPriorityRange(&least, &greatest)) != cudaSuccess ||
      (e = cudaStreamCreateWithPriority(&c->stream_, cudaStreamNonBlocking, greatest)) !=
          cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "setting up the resident copier");
  }
  c->shared_dev_ = static_cast<ResidentShared*>(dev);
  // The gate needs stream memory operations; try one once.
  c->write_value_ = write_value_entry();
  if (c->write_value_ != nullptr) {
    auto fn = reinterpret_cast<WriteValue64Fn>(c->write_value_);
    if (fn(reinterpret_cast<CUstream>(c->stream_), reinterpret_cast<CUdeviceptr>(c->gate_), 0,
           CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS ||
        cudaStreamSynchronize(c->stream_) != cudaSuccess) {
      cudaGetLastError();
      c->write_value_ = nullptr;
    }
  }
  return c;
}

ResidentCopier::~ResidentCopier() {
  DeviceGuard g(device_);
  if (shared_ != nullptr) {
    *reinterpret_cast<volatile uint64_t*>(&shared_->quit) = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  if (gate_ != nullptr) cudaFree(gate_);
  if (shared_ != nullptr) cudaFreeHost(shared_);
  cudaGetLastError();
}

void ResidentCopier::refresh_exit() {
  if (!alive_) return;
  const uint64_t w = load_volatile(&shared_->exit_word);
  const uint64_t epoch_bits = (1ull << (64 - kResidentEpochShift)) - 1;
  if ((w >> kResidentEpochShift) == (epoch_ & epoch_bits)) {
    alive_ = false;
    exit_next_ = w & kResidentTicketMask;
  }
}

Status ResidentCopier::launch(uint64_t first_ticket) {
  ResidentLaunch l;
  l.shared = shared_dev_;
  l.gate = gate_;
  l.first_ticket = first_ticket;
  l.epoch = (++epoch_) & ((1ull << (64 - kResidentEpochShift)) - 1);
  l.linger_ns = static_cast<uint64_t>(opt_.linger.count()) * 1000;
  l.gate_wait_ns = static_cast<uint64_t>(opt_.gate_wait.count()) * 1000;
  if (cudaError_t e = launch_resident_copier(l, stream_); e != cudaSuccess) {
    broken_ = true;
    return cuda_status(e, "launching the resident copy kernel");
  }
  alive_ = true;
  ++launches_;
  return Status::Ok();
}

Result<uint64_t> ResidentCopier::post(void* dst, const void* src, uint64_t size,
                                      bool after_default_stream) {
  if (broken_ || size == 0 || size > kResidentTicketMask) return uint64_t{0};
  if (after_default_stream && write_value_ == nullptr) return uint64_t{0};
  const uint64_t t = next_;
  if (t > kResidentTicketMask) return uint64_t{0};  // 2^40 copies: the ring is retired
  uint64_t* status = &shared_->status[t % kResidentSlots];
  // The slot is free once the posting kResidentSlots before has been resolved.
  if (t > kResidentSlots && (load_volatile(status) >> 2) < t - kResidentSlots) return uint64_t{0};
  ResidentSlot& slot = shared_->slots[t % kResidentSlots];
  auto publish = [&](uint64_t flags) {
    store_half(&slot.dst, reinterpret_cast<uint64_t>(dst), t);
    store_half(&slot.src, reinterpret_cast<uint64_t>(src), t);
    store_half(&slot.size_flags, size | flags, t);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  };
  if (!after_default_stream) {
    publish(0);
  } else if (!opt_.query_default_stream) {
    if (!queue_gate(t)) return uint64_t{0};
    publish(kResidentWaitGate);
  } else {
    // Post first and ask the legacy stream (one cudaStreamQuery, ~1.8 us of
    // host time) while a running kernel takes the slot over PCIe; the answer
    // follows in the slot's decision word. Idle: nothing to wait for. Busy:
    // the gate's round trip through the stream (~3.5 us on 4 x H100,
    // docs/benchmarks.md). A gate that cannot be queued: a decision never
    // comes, and the kernel defers the copy to the ordinary stream.
    publish(kResidentDecide);
    const cudaError_t q = cudaStreamQuery(cudaStreamLegacy);
    bool gated = q != cudaSuccess;
    if (q != cudaSuccess && q != cudaErrorNotReady) cudaGetLastError();
    if (!gated || queue_gate(t)) {
      store_volatile(&shared_->decision[t % kResidentSlots],
                     (t << 2) | (gated ? kResidentGated : kResidentOpen));
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
  }
  ++next_;
  refresh_exit();
  if (!alive_) {
    // The last kernel left having taken everything before `exit_next_`.
    const uint64_t first = exit_next_ < t ? exit_next_ : t;
    if (Status s = launch(first); !s.ok()) return s;
  }
  return t;
}

bool ResidentCopier::queue_gate(uint64_t t) {
  auto fn = reinterpret_cast<WriteValue64Fn>(write_value_);
  // Tickets are posted in order under the caller's lock, so the gate only
  // grows. CU_STREAM_LEGACY: the stream whose earlier work the copy waits for.
  if (fn(CU_STREAM_LEGACY, reinterpret_cast<CUdeviceptr>(gate_), t,
         CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
    cudaGetLastError();
    return false;
  }
  return true;
}

Result<ResidentCopier::State> ResidentCopier::state(uint64_t t) {
  const uint64_t s = load_volatile(&shared_->status[t % kResidentSlots]);
  if ((s >> 2) == t) return (s & 3) == kResidentDone ? State::kDone : State::kDeferred;
  refresh_exit();
  if (!alive_) {
    if (broken_) return State::kDeferred;  // no kernel will take it: copy it another way
    if (exit_next_ <= t) {
      // Posted as the last kernel left (or after it deferred one): start
      // another where it stopped.
      DeviceGuard g(device_);
      if (Status st = launch(exit_next_); !st.ok()) return State::kDeferred;
    }
  }
  return State::kPending;
}

}  // namespace ferry::cuda
