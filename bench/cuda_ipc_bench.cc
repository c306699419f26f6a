// ferry-cuda-ipc-bench: GPU memory of another process on this host, written
// by this one -- Ferry over cuda_ipc and, in the same run, Ferry forced to
// tcp (what GPU memory took before cuda_ipc) and the ceiling: one contiguous
// cudaMemcpyAsync of the same bytes inside this process.
//
//   ferry-cuda-ipc-bench [--iters N]
//
// The target is ferry_cuda_ipc_peer (tests/gpu), started twice: once for the
// cuda_ipc engine, once for the tcp-only one. This process uses GPU 0, the
// target GPU $FERRY_TEST_PEER_DEVICE (default 0); with the target on another
// GPU the ceiling is a peer copy GPU 0 -> that GPU (peer access enabled).
// --no-tcp leaves tcp out (for runs comparing cuda_ipc options, set as
// FERRY_CUDA_IPC_* variables). Every workload's bytes are checked once by the
// target.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/stage_trace.h"
#include "ferry/engine.h"
#include "target_process.h"
#include "tcp_gpu_common.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kRemote = 400u << 20;
constexpr size_t kLocal = 400u << 20;

struct Side {
  gputest::TargetProcess target;
  std::unique_ptr<Engine> engine;
  PeerId peer = 0;
  RemoteDescriptor desc;
  std::string carrier;
};

bool g_trace = false;  // --trace: the cuda_ipc engine traces its transfers

bool setup(Side& s, const std::string& transports, void* local) {
  std::string error;
  if (!s.target.start(FERRY_CUDA_IPC_PEER, 0, &error)) {
    std::fprintf(stderr, "target: %s\n", error.c_str());
    return false;
  }
  std::fprintf(stderr, "setup %s: target up\n", transports.c_str());
  EngineConfig config;
  config.options["engine.transports"] = transports;
  if (g_trace && transports != "tcp") {
    config.options["cuda_ipc.trace"] = "true";
    config.options["cuda_ipc.trace_keep"] = "65536";
  }
  auto e = Engine::create(config);
  if (!e.ok()) return false;
  s.engine = std::move(e.value());
  auto p = s.engine->connect(gputest::unhex(s.target.ready_fields()[1]));
  if (!p.ok()) {
    std::fprintf(stderr, "connect: %s\n", p.status().to_string().c_str());
    return false;
  }
  s.peer = *p;
  std::fprintf(stderr, "setup %s: connected\n", transports.c_str());
  const std::string a = s.target.ask("alloc m malloc " + std::to_string(kRemote));
  std::fprintf(stderr, "setup %s: alloc answered %.60s\n", transports.c_str(), a.c_str());
  if (a.rfind("desc ", 0) != 0) return false;
  s.desc = RemoteDescriptor::from_bytes(gputest::unhex(a.substr(5, a.find(' ', 5) - 5))).value();
  if (!s.engine->register_memory(local, kLocal).ok()) return false;
  const auto routes = s.engine->peer_transports(s.peer);  // kept: the loop reads into it
  for (const auto& t : routes.value()) {
    if (t.carries.find("peer GPU") != std::string::npos) s.carrier = t.transport;
  }
  return true;
}

double pct(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

int64_t ns_of(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// --trace: where one blocking write's time goes, p50 of each step in us: the
// call until the transport has it (core), the transport's post until its
// copies are submitted, until a poll saw them done, until the transfer
// completed, and until write() returned.
void print_breakdown(Side& s, const std::vector<std::pair<int64_t, int64_t>>& calls) {
  std::vector<TraceRecord> recs = take_engine_traces(s.engine->id());
  if (recs.size() < calls.size()) {
    std::printf("   trace: %zu records for %zu calls\n", recs.size(), calls.size());
    return;
  }
  recs.erase(recs.begin(), recs.end() - static_cast<std::ptrdiff_t>(calls.size()));
  std::vector<double> core, submit, copy, finish, ret;
  for (size_t i = 0; i < calls.size(); ++i) {
    const TraceRecord& r = recs[i];
    const int64_t posted = r.at(TraceStage::kPosted), sub = r.at(TraceStage::kStageCopySubmitted),
                  done = r.at(TraceStage::kStageCopyDone), fin = r.at(TraceStage::kCompleted);
    if (posted == 0 || sub == 0 || done == 0 || fin == 0) continue;
    core.push_back((posted - calls[i].first) / 1e3);
    submit.push_back((sub - posted) / 1e3);
    copy.push_back((done - sub) / 1e3);
    finish.push_back((fin - done) / 1e3);
    ret.push_back((calls[i].second - fin) / 1e3);
  }
  if (core.empty()) return;
  std::printf(
      "   p50 us: call->posted %.2f, posted->copy submitted %.2f, ->copy seen done %.2f, "
      "->completed %.2f, ->returned %.2f (%zu calls)\n",
      pct(core, 0.5), pct(submit, 0.5), pct(copy, 0.5), pct(finish, 0.5), pct(ret, 0.5),
      core.size());
}

// p50 / p99 of one blocking write of `bytes`.
std::pair<double, double> latency(Side& s, uint8_t* local, uint64_t bytes, int iters,
                                  bool breakdown = false) {
  LocalIov l{local, bytes};
  RemoteIov r{&s.desc, 0, bytes};
  std::vector<double> us;
  std::vector<std::pair<int64_t, int64_t>> calls;
  for (int i = 0; i < iters + 50; ++i) {
    const auto t0 = Clock::now();
    if (!s.engine->write(s.peer, {&l, 1}, {&r, 1}).ok()) return {-1, -1};
    const auto t1 = Clock::now();
    if (i >= 50) {
      us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      calls.emplace_back(ns_of(t0), ns_of(t1));
    }
  }
  if (breakdown && g_trace) print_breakdown(s, calls);
  return {pct(us, 0.5), pct(us, 0.99)};
}

// GB/s of `calls` calls of `n` blocks of `block` bytes, `depth` in flight.
// *post_us_per_call: time spent inside write_async per call (the host's part).
// `scattered`: the remote blocks in a shuffled order (pages of a KV cache),
// so no two iovs are adjacent on both sides and none is merged.
double throughput(Side& s, uint8_t* local, uint64_t block, size_t n, int depth, int calls,
                  bool scattered, double* post_us_per_call = nullptr) {
  std::vector<LocalIov> l(n);
  std::vector<RemoteIov> r(n);
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  if (scattered) std::shuffle(order.begin(), order.end(), std::mt19937_64(42));
  for (size_t i = 0; i < n; ++i) {
    l[i] = {local + i * block, block};
    r[i] = {&s.desc, order[i] * block, block};
  }
  std::vector<TransferId> window;
  const auto t0 = Clock::now();
  double post_us = 0;
  for (int c = 0; c < calls; ++c) {
    if (window.size() == static_cast<size_t>(depth)) {
      if (!s.engine->wait(window.front(), std::chrono::seconds(60)).ok()) return -1;
      window.erase(window.begin());
    }
    const auto p0 = Clock::now();
    auto id = s.engine->write_async(s.peer, l, r);
    post_us += std::chrono::duration<double, std::micro>(Clock::now() - p0).count();
    if (!id.ok()) return -1;
    window.push_back(*id);
  }
  for (TransferId id : window) {
    if (!s.engine->wait(id, std::chrono::seconds(60)).ok()) return -1;
  }
  const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
  if (post_us_per_call != nullptr) *post_us_per_call = post_us / calls;
  return static_cast<double>(block * n) * calls / sec / 1e9;
}

bool verify(Side& s, uint8_t* local, uint64_t bytes) {
  std::vector<uint8_t> image(bytes);
  gputest::fill(image.data(), bytes, 77);
  cudaMemcpy(local, image.data(), bytes, cudaMemcpyHostToDevice);
  LocalIov l{local, bytes};
  RemoteIov r{&s.desc, 0, bytes};
  if (!s.engine->write(s.peer, {&l, 1}, {&r, 1}).ok()) return false;
  const std::string a = s.target.ask("sum m 0 " + std::to_string(bytes));
  return a == "sum " + std::to_string(gputest::fnv(image.data(), bytes));
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int iters = 2000;
  bool latency_only = false;
  bool with_tcp = true;
  std::vector<uint64_t> sizes = {4096, 65536, 1u << 20};  // blocking-write latency rows
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) iters = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--latency-only") == 0) latency_only = true;
    if (std::strcmp(argv[i], "--no-tcp") == 0) with_tcp = false;
    if (std::strcmp(argv[i], "--trace") == 0) g_trace = true;
    if (std::strcmp(argv[i], "--sizes") == 0 && i + 1 < argc) {
      sizes.clear();
      for (const char* p = argv[++i]; *p != '\0';) {
        char* end = nullptr;
        sizes.push_back(std::strtoull(p, &end, 10));
        p = *end == ',' ? end + 1 : end;
        if (sizes.back() == 0 || sizes.back() > kLocal) {
          std::printf("--sizes: each size must be 1..%llu bytes\n",
                      static_cast<unsigned long long>(kLocal));
          return 2;
        }
      }
    }
  }
  const int peer_device = gputest::peer_device();
  uint8_t *local = nullptr, *scratch = nullptr;
  // The ceiling's destination is on the target's GPU.
  if (cudaSetDevice(peer_device) != cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&scratch), kLocal) != cudaSuccess) {
    std::printf("no CUDA device %d\n", peer_device);
    return 1;
  }
  if (cudaSetDevice(0) != cudaSuccess) {
    std::printf("no CUDA device\n");
    return 1;
  }
  if (peer_device != 0 && cudaDeviceEnablePeerAccess(peer_device, 0) != cudaSuccess) {
    std::printf("note: no peer access GPU 0 -> GPU %d; the ceiling goes through the host\n",
                peer_device);
  }
  cudaMalloc(reinterpret_cast<void**>(&local), kLocal);
  std::printf("this process on GPU 0, target on GPU %d\n", peer_device);
  // The floor of a blocking copy: one cudaMemcpyAsync + stream synchronize,
  // inside this process.
  auto raw_latency = [&](uint64_t bytes) {
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    std::vector<double> us;
    for (int i = 0; i < iters + 50; ++i) {
      const auto t0 = Clock::now();
      cudaMemcpyAsync(scratch, local, bytes, cudaMemcpyDefault, st);
      cudaStreamSynchronize(st);
      if (i >= 50)
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    cudaStreamDestroy(st);
    return pct(us, 0.5);
  };
  // The same before any engine runs in this process: what the engines' threads
  // cost a copy issued beside them.
  std::printf("raw copy p50 before the engines: 4096 B %.1f us\n", raw_latency(4096));
  Side ipc, tcp;
  if (!setup(ipc, "auto", local) || (with_tcp && !setup(tcp, "tcp", local))) return 1;
  std::printf("carriers: auto engine -> %s, forced engine -> %s\n", ipc.carrier.c_str(),
              with_tcp ? tcp.carrier.c_str() : "(not run)");
  std::printf("bytes verified: %s / %s\n", verify(ipc, local, 64u << 20) ? "ok" : "MISMATCH",
              !with_tcp                       ? "-"
              : verify(tcp, local, 64u << 20) ? "ok"
                                              : "MISMATCH");

  // The ceiling: one contiguous copy of the same bytes, device to device.
  auto contiguous = [&](uint64_t bytes, int reps) {
    cudaStream_t st;
    cudaStreamCreate(&st);
    cudaMemcpyAsync(scratch, local, bytes, cudaMemcpyDefault, st);
    cudaStreamSynchronize(st);
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) cudaMemcpyAsync(scratch, local, bytes, cudaMemcpyDefault, st);
    cudaStreamSynchronize(st);
    const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    cudaStreamDestroy(st);
    return static_cast<double>(bytes) * reps / sec / 1e9;
  };

  std::printf("\n%-34s %14s %14s %14s %14s %9s\n", "blocking write latency (us)", "cuda_ipc p50",
              "tcp p50", "cuda_ipc p99", "raw copy p50", "tcp/ipc");
  for (uint64_t b : sizes) {
    auto a = latency(ipc, local, b, iters, /*breakdown=*/true);
    auto t = with_tcp ? latency(tcp, local, b, iters / 4) : std::pair<double, double>{0, 0};
    std::printf("%-34s %14.1f %14.1f %14.1f %14.1f %8.1fx\n", (std::to_string(b) + " B").c_str(),
                a.first, t.first, a.second, raw_latency(b), with_tcp ? t.first / a.first : 0.0);
  }
  if (latency_only) return 0;
  std::printf("\n%-34s %10s %10s %10s %9s %9s %10s\n", "throughput (GB/s), 4 in flight", "cuda_ipc",
              "tcp", "contig", "ipc/cont", "ipc/tcp", "post us");
  struct W {
    const char* name;
    uint64_t block;
    size_t n;
    int depth;
    bool scattered;
  } ws[] = {{"128 x 1179648 B adjacent", 1179648, 128, 4, false},
            {"128 x 1179648 B scattered", 1179648, 128, 4, true},
            {"298 x 1179648 B scattered", 1179648, 298, 4, true},
            {"4096 x 4 KiB adjacent", 4096, 4096, 4, false},
            {"4096 x 4 KiB scattered", 4096, 4096, 4, true},
            {"16 MiB x 1", 16u << 20, 1, 4, false}};
  for (const W& w : ws) {
    const double c = contiguous(w.block * w.n, 20);
    double post_us = 0;
    const double a = throughput(ipc, local, w.block, w.n, w.depth, 40, w.scattered, &post_us);
    const double t = with_tcp ? throughput(tcp, local, w.block, w.n, w.depth, 4, w.scattered) : 0.0;
    std::printf("%-34s %10.1f %10.2f %10.1f %8.2fx %8.1fx %10.1f\n", w.name, a, t, c, a / c,
                with_tcp ? a / t : 0.0, post_us);
  }
  return 0;
}
