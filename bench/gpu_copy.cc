// ferry-gpu-copy-bench: scattered block copies between pinned host memory and
// GPU memory. In one program, alternating per repetition: Ferry's CopyStream
// (default options, and at SM budgets 4/8/16/32, kernel-only and copy-engine
// only) against a per-block cudaMemcpyAsync loop, one cudaMemcpyBatchAsync,
// and one contiguous cudaMemcpyAsync of the same bytes (the link's limit).
// Median of the repetitions, timed with CUDA events on the stream that runs
// the work; every Ferry variant's result is verified once, outside timing.
//
//   ferry-gpu-copy-bench [--json] [--total-mib N] [--reps N]
//                        [--sizes 4096,16384,...] [--dirs h2d,d2h,d2d] [--no-kv]
//                        [--extra] [--seq] [--order shuffle|rotate] [--gap-us N]
//
// --extra adds the diagnostic variants (kernel host-load policies, a
// kernel/copy-engine mix); --seq adds, per size, the same blocks in address
// order (not shuffled). "submit us" is the host's time inside submit().
// --order: per repetition the methods run in a freshly shuffled order
// (default) or rotated (each method then nearly always follows the same one:
// the defaults variant followed the 65536-call cudaMemcpyBatchAsync and
// measured ~0.005 below the identical sm16 variant, see docs/gpu.md);
// --gap-us N: the host idles N us, GPU synchronized, before each timed run.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ferry/gpu.h"

namespace {

#define CHECK(expr)                                                                               \
  do {                                                                                            \
    cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fflush(stdout);                                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

struct Args {
  bool json = false;
  uint64_t total = 256ull << 20;
  int reps = 5;
  std::vector<uint64_t> sizes = {4096, 16384, 65536, 262144, 1048576};
  std::vector<std::string> dirs = {"H2D", "D2H"};
  bool kv = true;  // + the KV-cache page shape: 298 blocks of 1,179,648 bytes
  bool extra = false;
  bool seq = false;
  bool shuffle_order = true;
  int gap_us = 0;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= s.size()) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    if (q > p) out.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return out;
}

bool parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    if (k == "--json") {
      a->json = true;
    } else if (k == "--no-kv") {
      a->kv = false;
    } else if (k == "--extra") {
      a->extra = true;
    } else if (k == "--seq") {
      a->seq = true;
    } else if (k == "--order") {
      const char* v = next();
      if (v == nullptr || (std::string(v) != "rotate" && std::string(v) != "shuffle")) return false;
      a->shuffle_order = std::string(v) == "shuffle";
    } else if (k == "--gap-us") {
      const char* v = next();
      if (v == nullptr) return false;
      a->gap_us = std::max(0, std::atoi(v));
    } else if (k == "--total-mib") {
      const char* v = next();
      if (v == nullptr) return false;
      a->total = std::strtoull(v, nullptr, 10) << 20;
    } else if (k == "--reps") {
      const char* v = next();
      if (v == nullptr) return false;
      a->reps = std::max(1, std::atoi(v));
    } else if (k == "--sizes") {
      const char* v = next();
      if (v == nullptr) return false;
      a->sizes.clear();
      for (auto& s : split(v)) a->sizes.push_back(std::strtoull(s.c_str(), nullptr, 10));
    } else if (k == "--dirs") {
      const char* v = next();
      if (v == nullptr) return false;
      a->dirs = split(v);
      for (auto& d : a->dirs) {
        for (auto& c : d) c = static_cast<char>(std::toupper(c));
      }
    } else {
      return false;
    }
  }
  return a->total > 0 && !a->sizes.empty();
}

struct Workload {
  std::string dir;  // H2D, D2H, D2D
  std::string name;
  uint64_t block;
  size_t count;
  std::vector<ferry::CopyBlock> blocks;  // shuffled, scattered
  void* contig_dst;
  const void* contig_src;
};

struct Method {
  std::string name;
  int sm_budget = -1;  // Ferry variants only
  ferry::CopyOptions opts;
  ferry::CopyStream* fs = nullptr;  // Ferry variants only
  std::vector<double> gbps;
  std::vector<double> submit_us;  // host time inside submit(), Ferry variants only
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!parse(argc, argv, &args)) {
    std::fprintf(stderr,
                 "usage: %s [--json] [--total-mib N] [--reps N] [--sizes a,b,..] "
                 "[--dirs h2d,d2h,d2d] [--no-kv] [--extra] [--seq] [--order shuffle|rotate] "
                 "[--gap-us N]\n",
                 argv[0]);
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines stay whole next to stderr
  std::string reason;
  if (!ferry::cuda_available(&reason)) {
    std::printf("skipped: %s\n", reason.c_str());
    return 0;
  }
  CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  char date[32];
  std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::printf("# ferry-gpu-copy-bench  %s  %s, %d SMs, PCI %04x:%02x:%02x, runtime %d, driver %d\n",
              date, prop.name, prop.multiProcessorCount, prop.pciDomainID, prop.pciBusID,
              prop.pciDeviceID, rt, drv);

  const uint64_t kv_block = 1179648, kv_count = 298;
  const uint64_t cap = std::max(args.total, args.kv ? kv_block * kv_count : 0);
  uint8_t *host = nullptr, *dev = nullptr, *dev2 = nullptr;
  CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), cap, cudaHostAllocDefault));
  CHECK(cudaMalloc(reinterpret_cast<void**>(&dev), cap));
  const bool want_d2d = std::find(args.dirs.begin(), args.dirs.end(), "D2D") != args.dirs.end();
  if (want_d2d) CHECK(cudaMalloc(reinterpret_cast<void**>(&dev2), cap));
  // Source pattern: 64-bit word index, so a misplaced block is caught.
  std::vector<uint64_t> pattern(cap / 8);
  std::iota(pattern.begin(), pattern.end(), 0x1000000000ull);
  std::memcpy(host, pattern.data(), cap);
  CHECK(cudaMemcpy(dev, pattern.data(), cap, cudaMemcpyHostToDevice));
  if (dev2 != nullptr) CHECK(cudaMemcpy(dev2, pattern.data(), cap, cudaMemcpyHostToDevice));
  CHECK(cudaDeviceSynchronize());

  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  // Ferry variants, each on its own CopyStream.
  std::vector<Method> ferry_methods;
  std::vector<std::unique_ptr<ferry::CopyStream>> streams;
  // `knob`/`value`: one of CopyStream's diagnostic environment knobs
  // (docs/gpu.md), set only while this variant's stream is created.
  auto add_ferry = [&](std::string name, int budget, uint64_t kmax, const char* knob = nullptr,
                       const char* value = nullptr) {
    Method m;
    m.name = std::move(name);
    m.sm_budget = budget;
    m.opts.sm_budget = static_cast<uint32_t>(budget);
    if (kmax != 0) m.opts.kernel_max_block = kmax;
    if (knob != nullptr) setenv(knob, value, 1);
    auto r = ferry::CopyStream::create(0, m.opts);
    if (knob != nullptr) unsetenv(knob);
    if (!r.ok()) {
      std::fprintf(stderr, "CopyStream::create(%s): %s\n", m.name.c_str(),
                   r.status().to_string().c_str());
      std::exit(1);
    }
    streams.push_back(std::move(r).value());
    m.fs = streams.back().get();
    ferry_methods.push_back(m);
  };
  add_ferry("ferry", ferry::CopyOptions{}.sm_budget, 0);  // index 0: the defaults
  for (int b : {4, 8, 16, 32}) add_ferry("ferry-sm" + std::to_string(b), b, 0);  // sm8: index 2
  add_ferry("ferry-kernel-only", 16, UINT64_MAX);
  add_ferry("ferry-engine-only", 0, 0);
  // The launch schedule before 2026-11-23 (first slice 1024, 4x growth).
  add_ferry("ferry-slices-1024x4", ferry::CopyOptions{}.sm_budget, 0, "FERRY_GATHER_SLICES",
            "1024,4,32768");
  if (args.extra) {
    add_ferry("ferry-slices-128x2", ferry::CopyOptions{}.sm_budget, 0, "FERRY_GATHER_SLICES",
              "128,2,32768");
    add_ferry("ferry-slices-256x2-max8k", ferry::CopyOptions{}.sm_budget, 0, "FERRY_GATHER_SLICES",
              "256,2,8192");
    // Host-load variants of the kernel and a kernel/copy-engine mix.
    add_ferry("ferry-sm8-cs", 8, 0, "FERRY_GATHER_HOST_LOAD", "cs");
    add_ferry("ferry-sm8-pf256", 8, 0, "FERRY_GATHER_HOST_LOAD", "pf256");
    add_ferry("ferry-mix-ce4", ferry::CopyOptions{}.sm_budget, 0, "FERRY_GATHER_CE_EVERY", "4");
  }

  // Workloads.
  std::vector<Workload> work;
  std::mt19937_64 rng(42);
  auto make = [&](const std::string& dir, const std::string& name, uint64_t bs, size_t n,
                  bool shuffled = true) {
    Workload w;
    w.dir = dir;
    w.name = name;
    w.block = bs;
    w.count = n;
    uint8_t* src = dir == "H2D" ? host : dev;
    uint8_t* dst = dir == "H2D" ? dev : dir == "D2H" ? host : dev2;
    std::vector<size_t> sp(n), dp(n);
    std::iota(sp.begin(), sp.end(), 0);
    std::iota(dp.begin(), dp.end(), 0);
    if (shuffled) {
      std::shuffle(sp.begin(), sp.end(), rng);
      std::shuffle(dp.begin(), dp.end(), rng);
    }
    for (size_t i = 0; i < n; ++i) w.blocks.push_back({dst + dp[i] * bs, src + sp[i] * bs, bs});
    w.contig_dst = dst;
    w.contig_src = src;
    work.push_back(std::move(w));
  };
  for (const std::string& dir : args.dirs) {
    for (uint64_t bs : args.sizes) {
      const std::string name =
          std::to_string(bs >= 1048576 ? bs >> 20 : bs >> 10) + (bs >= 1048576 ? "MiB" : "KiB");
      make(dir, name, bs, args.total / bs);
      if (args.seq) make(dir, name + "-seq", bs, args.total / bs, false);
    }
    if (args.kv) make(dir, "kv-1152KiB", kv_block, kv_count);
  }

  struct Row {
    std::string method;
    int budget;
    double gbps;
  };
  std::vector<std::string> floor_lines;
  bool floors_ok = true;
  int verify_failures = 0;

  for (Workload& w : work) {
    const uint64_t bytes = w.block * w.count;
    std::vector<void*> dsts(w.count);
    std::vector<const void*> srcs(w.count);
    std::vector<size_t> sizes(w.count, w.block);
    for (size_t i = 0; i < w.count; ++i) {
      dsts[i] = w.blocks[i].dst;
      srcs[i] = w.blocks[i].src;
    }
    std::vector<Method> refs(3);
    refs[0].name = "contiguous";
    refs[1].name = "memcpy-loop";
    refs[2].name = "memcpy-batch";

    auto timed = [&](cudaStream_t st, auto&& body) -> double {
      if (args.gap_us > 0) {
        CHECK(cudaDeviceSynchronize());
        std::this_thread::sleep_for(std::chrono::microseconds(args.gap_us));
      }
      CHECK(cudaEventRecord(e0, st));
      body();
      CHECK(cudaEventRecord(e1, st));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return bytes / (ms * 1e-3) / 1e9;
    };
    auto run_ref = [&](int which) -> double {
      return timed(s, [&] {
        if (which == 0) {
          CHECK(cudaMemcpyAsync(w.contig_dst, w.contig_src, bytes, cudaMemcpyDefault, s));
        } else if (which == 1) {
          for (size_t i = 0; i < w.count; ++i) {
            CHECK(cudaMemcpyAsync(dsts[i], srcs[i], w.block, cudaMemcpyDefault, s));
          }
        } else {
#if CUDART_VERSION >= 12080
          cudaMemcpyAttributes attr{};
          attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
          attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
          size_t idx = 0;
#if CUDART_VERSION >= 13000
          CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), w.count, &attr, &idx,
                                     1, s));
#else
          size_t fail = 0;
          CHECK(cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(),
                                     w.count, &attr, &idx, 1, &fail, s));
#endif
#else
          for (size_t i = 0; i < w.count; ++i) {
            CHECK(cudaMemcpyAsync(dsts[i], srcs[i], w.block, cudaMemcpyDefault, s));
          }
#endif
        }
      });
    };
    auto run_ferry = [&](Method& m) -> double {
      auto fs_stream = static_cast<cudaStream_t>(m.fs->native_stream());
      uint64_t ticket = 0;
      double g = timed(fs_stream, [&] {
        const auto h0 = std::chrono::steady_clock::now();
        auto t = m.fs->submit(w.blocks);
        m.submit_us.push_back(
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0)
                .count());
        if (!t.ok()) {
          std::fprintf(stderr, "%s: submit: %s\n", m.name.c_str(), t.status().to_string().c_str());
          std::exit(1);
        }
        ticket = t.value();
      });
      ferry::Status st = m.fs->wait(ticket, std::chrono::milliseconds(60000));
      if (!st.ok()) {
        std::fprintf(stderr, "%s: wait: %s\n", m.name.c_str(), st.to_string().c_str());
        std::exit(1);
      }
      return g;
    };
    // Poison the destination, run once, check every block (outside timing).
    std::vector<uint8_t> src_snapshot;
    auto verify = [&](Method& m) {
      uint8_t* dbase = static_cast<uint8_t*>(w.contig_dst);
      if (w.dir == "D2H") {
        std::memset(dbase, 0xEE, bytes);
      } else {
        CHECK(cudaMemset(dbase, 0xEE, bytes));
        CHECK(cudaDeviceSynchronize());  // Ferry's stream does not wait for the legacy one
      }
      run_ferry(m);
      std::vector<uint8_t> got(bytes);
      CHECK(cudaMemcpy(got.data(), dbase, bytes, cudaMemcpyDefault));
      const uint8_t* pat = src_snapshot.data();
      const uint8_t* sbase = static_cast<const uint8_t*>(w.contig_src);
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < w.blocks.size(); ++i) {
        const ferry::CopyBlock& b = w.blocks[i];
        const size_t doff = static_cast<const uint8_t*>(b.dst) - dbase;
        const size_t soff = static_cast<const uint8_t*>(b.src) - sbase;
        if (std::memcmp(got.data() + doff, pat + soff, b.size) != 0) {
          if (bad++ == 0) first = i;
        }
      }
      if (bad != 0) {
        const ferry::CopyBlock& b = w.blocks[first];
        const size_t doff = static_cast<const uint8_t*>(b.dst) - dbase;
        std::printf(
            "VERIFY FAILED: %s %s %s: %zu of %zu blocks wrong, first is list index %zu "
            "(dst+%zu, first byte 0x%02x)\n",
            w.dir.c_str(), w.name.c_str(), m.name.c_str(), bad, w.blocks.size(), first, doff,
            got[doff]);
        ++verify_failures;
      }
    };
    // What the source holds now (earlier workloads rewrote device memory).
    src_snapshot.resize(bytes);
    CHECK(cudaMemcpy(src_snapshot.data(), w.contig_src, bytes, cudaMemcpyDefault));
    for (Method& m : ferry_methods) {
      m.gbps.clear();
      verify(m);
    }
    for (Method& m : ferry_methods) m.submit_us.clear();
    // Warm-up, then repetitions with the methods alternating.
    for (int r = 0; r < 3; ++r) run_ref(r);
    for (Method& m : ferry_methods) run_ferry(m);
    // The order changes per repetition (shuffled, or rotated with --order rotate).
    const size_t nm = 3 + ferry_methods.size();
    std::mt19937 order_rng(7);
    for (int rep = 0; rep < args.reps; ++rep) {
      std::vector<size_t> order(nm);
      for (size_t k = 0; k < nm; ++k) order[k] = (k + rep) % nm;
      if (args.shuffle_order) std::shuffle(order.begin(), order.end(), order_rng);
      for (size_t k = 0; k < nm; ++k) {
        const size_t j = order[k];
        if (j < 3) {
          refs[j].gbps.push_back(run_ref(static_cast<int>(j)));
        } else {
          Method& m = ferry_methods[j - 3];
          m.gbps.push_back(run_ferry(m));
        }
      }
    }
    const double contig = median(refs[0].gbps), loop = median(refs[1].gbps),
                 batch = median(refs[2].gbps);
    std::printf("\n%s %s x %zu (%.1f MiB)\n", w.dir.c_str(), w.name.c_str(), w.count,
                bytes / 1048576.0);
    std::printf("  %-24s %9s %12s %12s %11s\n", "method", "GB/s", "vs contig", "vs batch",
                "submit us");
    for (const Method& m : refs) {
      const double g = median(m.gbps);
      std::printf("  %-24s %9.2f %12.3f %12.3f\n", m.name.c_str(), g, g / contig, g / batch);
    }
    for (const Method& m : ferry_methods) {
      const double g = median(m.gbps);
      std::printf("  %-24s %9.2f %12.3f %12.3f %11.1f\n", m.name.c_str(), g, g / contig, g / batch,
                  median(m.submit_us));
    }
    if (args.json) {
      auto emit = [&](const Method& m) {
        const double g = median(m.gbps);
        std::printf(
            "{\"bench\":\"gpu_copy\",\"gpu\":\"%s\",\"date\":\"%s\",\"dir\":\"%s\","
            "\"workload\":\"%s\",\"block\":%llu,\"blocks\":%zu,\"bytes\":%llu,\"method\":\"%s\","
            "\"sm_budget\":%d,\"gbps\":%.3f,\"contiguous_gbps\":%.3f,\"loop_gbps\":%.3f,"
            "\"batch_gbps\":%.3f,\"ratio_vs_contiguous\":%.4f,\"submit_us\":%.1f,"
            "\"reps\":%d}\n",
            prop.name, date, w.dir.c_str(), w.name.c_str(),
            static_cast<unsigned long long>(w.block), w.count,
            static_cast<unsigned long long>(bytes), m.name.c_str(), m.sm_budget, g, contig, loop,
            batch, g / contig, median(m.submit_us), args.reps);
      };
      for (const Method& m : refs) emit(m);
      for (const Method& m : ferry_methods) emit(m);
    }
    // The floors (H2D/D2H only).
    if (w.dir != "D2D" && w.name.find("-seq") == std::string::npos) {
      const double f = median(ferry_methods[0].gbps) / contig;
      const bool ok = f >= 0.90;
      floors_ok &= ok;
      char line[200];
      std::snprintf(line, sizeof line, "%-4s %-11s ferry (default)   %.3f x contiguous  %s",
                    w.dir.c_str(), w.name.c_str(), f, ok ? "PASS" : "FAIL");
      floor_lines.push_back(line);
      if (w.block == 4096) {
        const double f8 = median(ferry_methods[2].gbps) / contig;  // ferry-sm8
        const bool ok8 = f8 >= 0.90;
        floors_ok &= ok8;
        std::snprintf(line, sizeof line, "%-4s %-11s ferry sm_budget=8 %.3f x contiguous  %s",
                      w.dir.c_str(), w.name.c_str(), f8, ok8 ? "PASS" : "FAIL");
        floor_lines.push_back(line);
      }
    }
  }
  std::printf("\n# floors (>= 0.90 x contiguous)\n");
  for (auto& l : floor_lines) std::printf("%s\n", l.c_str());
  std::printf("# all floors %s\n", floors_ok ? "met" : "NOT met");
  std::printf("# verification: %s\n", verify_failures == 0 ? "every Ferry variant correct"
                                                           : "FAILURES (see VERIFY FAILED)");
  std::fflush(stdout);

  streams.clear();
  cudaFreeHost(host);
  cudaFree(dev);
  if (dev2 != nullptr) cudaFree(dev2);
  return verify_failures == 0 ? 0 : 1;
}
