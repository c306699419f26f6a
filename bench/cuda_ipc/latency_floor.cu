// ferry-latency-floor: what one small blocking copy costs with each way of
// issuing it and of learning that it finished, inside one process, so that a
// transport's blocking latency can be read against the primitives it is built
// from. GPU 0 -> GPU 1 (peer access on) where two GPUs are visible, else
// within GPU 0; and GPU 0 <-> pinned host memory (the tcp transport's staging
// copies). p50 / p99 in microseconds, one line per variant.
//
//   ferry-latency-floor [--iters N] [--bytes B]
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

// One CTA copies `n` bytes (a multiple of 16) with 16-byte accesses.
__global__ void copy_kernel(uint4* dst, const uint4* src, uint64_t n16) {
  for (uint64_t i = threadIdx.x; i < n16; i += blockDim.x) dst[i] = src[i];
}

// The same, then makes the copy visible system-wide and stores `seq` into a
// host-mapped word the host spins on: no event, no driver call to poll.
__global__ void copy_flag_kernel(uint4* dst, const uint4* src, uint64_t n16,
                                 volatile uint64_t* flag, uint64_t seq) {
  for (uint64_t i = threadIdx.x; i < n16; i += blockDim.x) dst[i] = src[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) *flag = seq;
}

__global__ void flag_kernel(volatile uint64_t* flag, uint64_t seq) {
  *flag = seq;
}

// A copy kernel that stays resident: the host posts a copy by writing a
// descriptor and then its sequence number into mapped host memory; one thread
// polls it, the block copies, and the sequence number is written back to a
// host-mapped word. No launch, no driver call per copy. Leaves after
// `idle_ns` without a descriptor, so a device synchronisation waits at most that.
struct Doorbell {
  volatile uint64_t seq;
  volatile uint64_t dst;
  volatile uint64_t src;
  volatile uint64_t n16;
};

__global__ void resident_copy_kernel(Doorbell* bell, volatile uint64_t* done, uint64_t first_seq,
                                     uint64_t idle_ns) {
  __shared__ uint64_t s_seq, s_dst, s_src, s_n16;
  __shared__ int s_quit;
  uint64_t next = first_seq;
  for (;;) {
    if (threadIdx.x == 0) {
      uint64_t t0, now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
      s_quit = 0;
      for (;;) {
        const uint64_t seq = bell->seq;
        if (seq >= next) {
          __threadfence_system();
          s_seq = seq;
          s_dst = bell->dst;
          s_src = bell->src;
          s_n16 = bell->n16;
          break;
        }
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - t0 > idle_ns) {
          s_quit = 1;
          break;
        }
      }
    }
    __syncthreads();
    if (s_quit) return;
    uint4* d = reinterpret_cast<uint4*>(s_dst);
    const uint4* sp = reinterpret_cast<const uint4*>(s_src);
    for (uint64_t i = threadIdx.x; i < s_n16; i += blockDim.x) d[i] = sp[i];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) *done = s_seq;
    next = s_seq + 1;
    __syncthreads();
  }
}

struct Stats {
  double p50, p99;
};

Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v[static_cast<size_t>(0.99 * (v.size() - 1))]};
}

Stats measure(int iters, const std::function<void(uint64_t)>& once) {
  std::vector<double> us;
  us.reserve(iters);
  for (int i = 0; i < iters + 100; ++i) {
    const auto t0 = Clock::now();
    once(static_cast<uint64_t>(i) + 1);
    if (i >= 100)
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return stats(us);
}

void spin_event(cudaEvent_t ev) {
  cudaError_t e;
  while ((e = cudaEventQuery(ev)) == cudaErrorNotReady) {
  }
  CHECK(e);
}

void spin_flag(volatile uint64_t* flag, uint64_t seq) {
  while (*flag != seq) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int iters = 5000;
  uint64_t bytes = 4096;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) iters = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--bytes") == 0 && i + 1 < argc)
      bytes = std::strtoull(argv[++i], nullptr, 0);
  }
  bytes = (bytes + 15) / 16 * 16;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIP: no CUDA device visible\n");
    return 0;
  }
  const int peer = n > 1 ? 1 : 0;
  void* dst = nullptr;
  CHECK(cudaSetDevice(peer));
  CHECK(cudaMalloc(&dst, bytes));
  CHECK(cudaSetDevice(0));
  if (peer != 0) CHECK(cudaDeviceEnablePeerAccess(peer, 0));
  void* src = nullptr;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMemset(src, 7, bytes));
  void* host = nullptr;
  CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  uint64_t* flag = nullptr;
  CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 64,
                      cudaHostAllocMapped | cudaHostAllocPortable));
  *flag = 0;
  uint64_t* flag_dev = nullptr;
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_dev), flag, 0));
  void* host_dev = nullptr;
  CHECK(cudaHostGetDevicePointer(&host_dev, host, 0));
  void* doorbell_host = nullptr;
  CHECK(cudaHostAlloc(&doorbell_host, 64, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(doorbell_host, 0, 64);
  void* doorbell_dev = nullptr;
  CHECK(cudaHostGetDevicePointer(&doorbell_dev, doorbell_host, 0));

  cudaStream_t blocking, nonblocking;
  CHECK(cudaStreamCreateWithFlags(&blocking, cudaStreamDefault));
  CHECK(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking));
  cudaEvent_t ev, legacy_ev;
  CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&legacy_ev, cudaEventDisableTiming));

  int can_write_value = 0;
  cuDeviceGetAttribute(&can_write_value, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, 0);
  char name[256] = {};
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::snprintf(name, sizeof name, "%s", prop.name);
  std::printf("# %s, %d GPU(s); %llu bytes, %d iterations; stream mem ops: %s\n", name, n,
              static_cast<unsigned long long>(bytes), iters, can_write_value ? "yes" : "no");

  struct Route {
    const char* name;
    void* to;
    const void* from;
    cudaMemcpyKind kind;
  };
  const std::string peer_name = peer != 0 ? "GPU0->GPU1" : "GPU0->GPU0";
  const Route routes[] = {{peer_name.c_str(), dst, src, cudaMemcpyDeviceToDevice},
                          {"GPU0->pinned host", host_dev, src, cudaMemcpyDeviceToHost},
                          {"pinned host->GPU0", src, host_dev, cudaMemcpyHostToDevice}};
  const uint64_t n16 = bytes / 16;
  std::printf("%-20s %-52s %8s %8s\n", "route", "variant", "p50 us", "p99 us");
  auto row = [&](const Route& r, const char* variant, Stats s) {
    std::printf("%-20s %-52s %8.2f %8.2f\n", r.name, variant, s.p50, s.p99);
  };
  for (const Route& r : routes) {
    row(r, "memcpyAsync + streamSynchronize (non-blocking stream)", measure(iters, [&](uint64_t) {
          CHECK(cudaMemcpyAsync(r.to, r.from, bytes, cudaMemcpyDefault, nonblocking));
          CHECK(cudaStreamSynchronize(nonblocking));
        }));
    row(r, "memcpyAsync + event, spin on eventQuery (non-blocking)", measure(iters, [&](uint64_t) {
          CHECK(cudaMemcpyAsync(r.to, r.from, bytes, cudaMemcpyDefault, nonblocking));
          CHECK(cudaEventRecord(ev, nonblocking));
          spin_event(ev);
        }));
    row(r, "memcpyAsync + event, spin on eventQuery (blocking)", measure(iters, [&](uint64_t) {
          CHECK(cudaMemcpyAsync(r.to, r.from, bytes, cudaMemcpyDefault, blocking));
          CHECK(cudaEventRecord(ev, blocking));
          spin_event(ev);
        }));
    // Two ways to order the copy after the legacy default stream without a
    // blocking stream: an event recorded there per copy, or a query first.
    row(r, "legacy event + streamWaitEvent + memcpyAsync + event spin",
        measure(iters, [&](uint64_t) {
          CHECK(cudaEventRecord(legacy_ev, cudaStreamLegacy));
          CHECK(cudaStreamWaitEvent(nonblocking, legacy_ev, 0));
          CHECK(cudaMemcpyAsync(r.to, r.from, bytes, cudaMemcpyDefault, nonblocking));
          CHECK(cudaEventRecord(ev, nonblocking));
          spin_event(ev);
        }));
    row(r, "legacy streamQuery + memcpyAsync + event spin", measure(iters, [&](uint64_t) {
          CHECK(cudaStreamQuery(cudaStreamLegacy));
          CHECK(cudaMemcpyAsync(r.to, r.from, bytes, cudaMemcpyDefault, nonblocking));
          CHECK(cudaEventRecord(ev, nonblocking));
          spin_event(ev);
        }));
    // Other entry points for the same copy: the kind named instead of
    // inferred (cudaMemcpyDefault looks both pointers up), and the driver's.
    row(r, "memcpyAsync(kind named) + event spin (non-blocking)", measure(iters, [&](uint64_t) {
          CHECK(cudaMemcpyAsync(r.to, r.from, bytes, r.kind, nonblocking));
          CHECK(cudaEventRecord(ev, nonblocking));
          spin_event(ev);
        }));
    row(r, "cuMemcpyAsync (driver) + event spin (non-blocking)", measure(iters, [&](uint64_t) {
          if (cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(r.to),
                            reinterpret_cast<CUdeviceptr>(r.from), bytes,
                            reinterpret_cast<CUstream>(nonblocking)) != CUDA_SUCCESS) {
            std::fprintf(stderr, "cuMemcpyAsync failed\n");
            std::exit(1);
          }
          CHECK(cudaEventRecord(ev, nonblocking));
          spin_event(ev);
        }));
    row(r, "memcpyAsync + streamQuery spin (non-blocking)", measure(iters, [&](uint64_t) {
          CHECK(cudaMemcpyAsync(r.to, r.from, bytes, cudaMemcpyDefault, nonblocking));
          cudaError_t e;
          while ((e = cudaStreamQuery(nonblocking)) == cudaErrorNotReady) {
          }
          CHECK(e);
        }));
#if CUDART_VERSION >= 13000
    row(r, "memcpyBatchAsync(1) + event spin (non-blocking)", measure(iters, [&](uint64_t) {
          void* d[1] = {r.to};
          const void* s[1] = {r.from};
          size_t z[1] = {bytes};
          cudaMemcpyAttributes attr{};
          attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
          attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
          size_t ai = 0;
          CHECK(cudaMemcpyBatchAsync(d, s, z, 1, &attr, &ai, 1, nonblocking));
          CHECK(cudaEventRecord(ev, nonblocking));
          spin_event(ev);
        }));
#endif
    if (can_write_value) {
      row(r, "memcpyAsync + cuStreamWriteValue64, spin on flag", measure(iters, [&](uint64_t seq) {
            CHECK(cudaMemcpyAsync(r.to, r.from, bytes, cudaMemcpyDefault, nonblocking));
            if (cuStreamWriteValue64(nonblocking, reinterpret_cast<CUdeviceptr>(flag_dev), seq,
                                     CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
              std::fprintf(stderr, "cuStreamWriteValue64 failed\n");
              std::exit(1);
            }
            spin_flag(flag, seq);
          }));
    }
    row(r, "memcpyAsync + flag kernel, spin on flag", measure(iters, [&](uint64_t seq) {
          CHECK(cudaMemcpyAsync(r.to, r.from, bytes, cudaMemcpyDefault, nonblocking));
          flag_kernel<<<1, 1, 0, nonblocking>>>(flag_dev, seq + 1000000000ull);
          spin_flag(flag, seq + 1000000000ull);
        }));
    for (int threads : {256, 1024}) {
      // Resident kernel, launched once; each copy is a descriptor in host memory.
      auto* bell = static_cast<Doorbell*>(doorbell_host);
      const uint64_t base = 3000000000ull + static_cast<uint64_t>(threads) * 10000000ull;
      bell->seq = 0;
      *flag = 0;
      resident_copy_kernel<<<1, threads, 0, nonblocking>>>(static_cast<Doorbell*>(doorbell_dev),
                                                           flag_dev, base + 1, 20000000ull);
      CHECK(cudaGetLastError());
      const std::string rk = "resident kernel 1 CTA x " + std::to_string(threads) + ", doorbell";
      row(r, rk.c_str(), measure(iters, [&](uint64_t seq) {
            bell->dst = reinterpret_cast<uint64_t>(r.to);
            bell->src = reinterpret_cast<uint64_t>(r.from);
            bell->n16 = n16;
            std::atomic_thread_fence(std::memory_order_release);
            bell->seq = base + seq;
            spin_flag(flag, base + seq);
          }));
      CHECK(cudaStreamSynchronize(nonblocking));
    }
    for (int threads : {256, 1024}) {
      const std::string k = "copy kernel 1 CTA x " + std::to_string(threads) + " + event spin";
      row(r, k.c_str(), measure(iters, [&](uint64_t) {
            copy_kernel<<<1, threads, 0, nonblocking>>>(static_cast<uint4*>(r.to),
                                                        static_cast<const uint4*>(r.from), n16);
            CHECK(cudaEventRecord(ev, nonblocking));
            spin_event(ev);
          }));
      const std::string f = "copy kernel 1 CTA x " + std::to_string(threads) + " writes flag";
      row(r, f.c_str(), measure(iters, [&](uint64_t seq) {
            copy_flag_kernel<<<1, threads, 0, nonblocking>>>(static_cast<uint4*>(r.to),
                                                             static_cast<const uint4*>(r.from), n16,
                                                             flag_dev, seq + 2000000000ull);
            spin_flag(flag, seq + 2000000000ull);
          }));
    }
  }
  // What a launch and a query cost the host alone.
  const Route& r0 = routes[0];
  auto host_us = [&](const std::function<void()>& f) {
    const int k = 2000;
    const auto t0 = Clock::now();
    for (int i = 0; i < k; ++i) f();
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / k;
    cudaDeviceSynchronize();
    return us;
  };
  std::printf(
      "# host cost per call (us): memcpyAsync %.2f, kernel launch %.2f, eventRecord %.2f, "
      "eventQuery (done) %.2f, legacy eventRecord + streamWaitEvent %.2f, legacy streamQuery "
      "%.2f\n",
      host_us([&] { cudaMemcpyAsync(r0.to, r0.from, bytes, cudaMemcpyDefault, nonblocking); }),
      host_us([&] {
        copy_kernel<<<1, 256, 0, nonblocking>>>(static_cast<uint4*>(r0.to),
                                                static_cast<const uint4*>(r0.from), n16);
      }),
      host_us([&] { cudaEventRecord(ev, nonblocking); }),
      host_us([&] { (void)cudaEventQuery(ev); }), host_us([&] {
        cudaEventRecord(legacy_ev, cudaStreamLegacy);
        cudaStreamWaitEvent(nonblocking, legacy_ev, 0);
      }),
      host_us([&] { (void)cudaStreamQuery(cudaStreamLegacy); }));
  return 0;
}
