// GPU memory over the tcp transport vs host memory over the same transport,
// alternating in one run (loopback, two engines in this process, real
// sockets). Workload: --block bytes x --batch iovs per WRITE (and READ).
// Prints one table row per (memory, op) and the ratio GPU / host.
// Each call uses the next slice of buffers N slices large, in turn (--rotate
// N). By default N makes every buffer at least twice the CPU's last-level
// cache, so that neither side measures the cache (KV-cache traffic has such
// a working set; a reused 16 MiB host buffer would stay cache-resident while
// GPU bytes always arrive through DMA). --rotate 1 reuses one slice: the
// cache-resident reference. --read-only skips the writes. --mix
// also measures one-sided staging (GPU memory on one side only: local GPU / remote host, local host
// / remote GPU), each against host/host.
// --depth N (N > 1) adds, beside each blocking row, a row with N async calls in
// flight (write_async/read_async, a new one started as the oldest completes),
// host and GPU alike; the calls in flight share the same buffers (throughput
// only, the bytes are not checked).
// --host-alloc pinned puts the host reference in cudaHostAlloc memory, as the
// GPU path's staging is (to tell the kind of memory from the copies' cost).
// --two-process puts the target in a second process (ferry_tcp_gpu_peer,
// $FERRY_TCP_GPU_PEER or beside this program), each side with its own CUDA
// context, as between a prefill and a decode server.
// --only host|gpu runs one of the pair alone (its partner reads 0), so that a
// profiler attached to the process sees one kind of transfer.
// --cpu prints, per row, the CPU time of each kind of thread (by thread name,
// both engines together) as a share of one core over the measured calls.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/engine.h"
#include "ferry/gpu.h"
#include "target_process.h"
#include "tcp_gpu_common.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

struct Side {
  uint8_t* local;
  RemoteDescriptor remote;
};

// CPU seconds per thread name: utime + stime, and stime alone (the kernel's
// share: socket copies) as "NAME sys" (/proc/self/task/*/stat).
std::map<std::string, double> cpu_by_thread_name() {
  std::map<std::string, double> out;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "stat");
    std::string line;
    if (!std::getline(in, line)) continue;
    const auto open = line.find('('), close = line.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    const std::string name = line.substr(open + 1, close - open - 1);
    std::istringstream rest(line.substr(close + 2));
    std::string field;
    double utime = 0, stime = 0;
    for (int k = 3; k <= 15 && rest >> field; ++k) {  // fields 14, 15: utime, stime
      if (k == 14) utime = std::stod(field);
      if (k == 15) stime = std::stod(field);
    }
    out[name] += (utime + stime) / tick;
    out[name + " sys"] += stime / tick;
  }
  return out;
}

// The largest CPU cache's size in bytes (sysfs, cpu0), 0 if unknown.
size_t last_level_cache_bytes() {
  size_t best = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::string text;
    if (!(in >> text) || text.empty()) continue;
    size_t value = std::strtoull(text.c_str(), nullptr, 10);
    if (text.back() == 'K') value <<= 10;
    if (text.back() == 'M') value <<= 20;
    best = std::max(best, value);
  }
  return best;
}

// Call k uses slice k % slices of each buffer (--rotate): with one slice every
// call reuses the same, cache-warm bytes.
double run(Engine& e, PeerId peer, const Side& side, bool write, uint64_t block, size_t batch,
           int iters, int depth, int slices, std::map<std::string, double>* cpu) {
  std::vector<std::vector<LocalIov>> ls(slices, std::vector<LocalIov>(batch));
  std::vector<std::vector<RemoteIov>> rs(slices, std::vector<RemoteIov>(batch));
  for (int k = 0; k < slices; ++k) {
    const uint64_t base = static_cast<uint64_t>(k) * block * batch;
    for (size_t i = 0; i < batch; ++i) {
      ls[k][i] = {side.local + base + i * block, block};
      rs[k][i] = {&side.remote, base + i * block, block};
    }
  }
  uint64_t call = 0;
  auto once = [&] {
    const auto& l = ls[call % slices];
    const auto& r = rs[call++ % slices];
    Status s = write ? e.write(peer, l, r) : e.read(peer, l, r);
    if (!s.ok()) {
      std::fprintf(stderr, "transfer failed: %s\n", s.to_string().c_str());
      std::exit(1);
    }
  };
  auto start = [&] {
    const auto& l = ls[call % slices];
    const auto& r = rs[call++ % slices];
    Result<TransferId> t = write ? e.write_async(peer, l, r) : e.read_async(peer, l, r);
    if (!t.ok()) {
      std::fprintf(stderr, "transfer failed to start: %s\n", t.status().to_string().c_str());
      std::exit(1);
    }
    return t.value();
  };
  auto finish = [&](TransferId t) {
    Status s = e.wait(t, std::chrono::seconds(60));
    if (!s.ok()) {
      std::fprintf(stderr, "transfer failed: %s\n", s.to_string().c_str());
      std::exit(1);
    }
  };
  for (int i = 0; i < 3; ++i) once();
  const auto cpu0 = cpu ? cpu_by_thread_name() : std::map<std::string, double>{};
  const auto t0 = Clock::now();
  if (depth <= 1) {
    for (int i = 0; i < iters; ++i) once();
  } else {
    std::deque<TransferId> q;
    for (int i = 0; i < iters; ++i) {
      if (q.size() == static_cast<size_t>(depth)) {
        finish(q.front());
        q.pop_front();
      }
      q.push_back(start());
    }
    for (TransferId t : q) finish(t);
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (cpu) {
    for (const auto& [name, sec] : cpu_by_thread_name()) {
      const auto before = cpu0.find(name);
      (*cpu)[name] += (sec - (before == cpu0.end() ? 0 : before->second)) / s;
    }
  }
  return static_cast<double>(block) * batch * iters / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t block = 1 << 20;
  size_t batch = 16;
  int iters = 40, reps = 5, depth = 1, slices = 0;  // 0: twice the last-level cache
  std::string host_alloc = "vector";
  std::string only;  // --only host|gpu: measure one side alone (for a profiler)
  bool mix = false, read_only = false, cpu = false, two_process = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--two-process") two_process = true;
    if (std::string(argv[i]) == "--mix") mix = true;
    if (std::string(argv[i]) == "--read-only") read_only = true;
    if (std::string(argv[i]) == "--cpu") cpu = true;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--mix" || a == "--read-only" || a == "--cpu" || a == "--two-process") {
      --i;
      continue;
    }
    if (a == "--block") block = std::stoull(argv[i + 1]);
    if (a == "--batch") batch = std::stoull(argv[i + 1]);
    if (a == "--iters") iters = std::stoi(argv[i + 1]);
    if (a == "--reps") reps = std::stoi(argv[i + 1]);
    if (a == "--depth") depth = std::max(1, std::stoi(argv[i + 1]));
    if (a == "--rotate") slices = std::max(1, std::stoi(argv[i + 1]));
    if (a == "--host-alloc") host_alloc = argv[i + 1];
    if (a == "--only") only = argv[i + 1];
  }
  std::string reason;
  if (!cuda_available(&reason)) {
    std::printf("skipped: %s\n", reason.c_str());
    return 0;
  }
  const size_t llc = last_level_cache_bytes();
  if (slices == 0) {
    const size_t call_bytes = block * batch;
    slices = static_cast<int>(std::max<size_t>(1, (2 * llc + call_bytes - 1) / call_bytes));
  }
  const size_t bytes = block * batch * slices;
  auto a = Engine::create().value();
  std::unique_ptr<Engine> b;  // the local target (not with --two-process)
  // --host-alloc pinned: the host reference in cudaHostAlloc memory (as the
  // GPU path's staging is), to tell the memory's kind from the copies' cost.
  // The local target's buffer (host_b) only without --two-process.
  std::vector<uint8_t> vec_a, vec_b;
  auto host_buffer = [&](std::vector<uint8_t>& vec, uint8_t fill) -> uint8_t* {
    uint8_t* p = nullptr;
    if (host_alloc == "pinned") {
      if (cudaHostAlloc(reinterpret_cast<void**>(&p), bytes, cudaHostAllocPortable) !=
          cudaSuccess) {
        std::printf("cudaHostAlloc of %zu bytes failed\n", bytes);
        std::exit(1);
      }
    } else {
      vec.resize(bytes);
      p = vec.data();
    }
    std::memset(p, fill, bytes);
    return p;
  };
  uint8_t* host_a_ptr = host_buffer(vec_a, 1);
  uint8_t* host_b_ptr = two_process ? nullptr : host_buffer(vec_b, 2);
  struct HostView {
    uint8_t* p;
    uint8_t* data() const { return p; }
  } host_a{host_a_ptr}, host_b{host_b_ptr};
  void *gpu_a = nullptr, *gpu_b = nullptr;
  cudaSetDevice(0);
  if (cudaMalloc(&gpu_a, bytes) != cudaSuccess ||
      (!two_process && cudaMalloc(&gpu_b, bytes) != cudaSuccess)) {
    std::printf("cudaMalloc failed\n");
    return 1;
  }
  cudaMemset(gpu_a, 1, bytes);
  a->register_memory(host_a.data(), bytes).value();
  a->register_memory(gpu_a, bytes).value();
  // The target: engine b here, or (--two-process) a ferry_tcp_gpu_peer
  // process with its own CUDA context, as a prefill and a decode server are.
  PeerId peer = 0;
  RemoteDescriptor remote_host, remote_gpu;
  gputest::TargetProcess target;
  if (two_process) {
    std::string error;
    if (!target.start(gputest::peer_program("ferry_tcp_gpu_peer"), bytes, &error)) {
      std::printf("cannot start the target process: %s\n", error.c_str());
      return 1;
    }
    peer = a->connect(gputest::unhex(target.ready_fields().at(1))).value();
    remote_gpu = RemoteDescriptor::from_bytes(gputest::unhex(target.ready_fields().at(2))).value();
    remote_host = RemoteDescriptor::from_bytes(gputest::unhex(target.ready_fields().at(3))).value();
  } else {
    b = Engine::create().value();
    auto rhb = b->register_memory(host_b.data(), bytes).value();
    auto rgb = b->register_memory(gpu_b, bytes).value();
    peer = a->connect(b->metadata()).value();
    remote_host = b->advertise(rhb.id).value();
    remote_gpu = b->advertise(rgb.id).value();
  }
  const Side host{host_a.data(), remote_host};
  const Side gpu{static_cast<uint8_t*>(gpu_a), remote_gpu};
  const Side gpu_to_host{static_cast<uint8_t*>(gpu_a), remote_host};
  const Side host_to_gpu{host_a.data(), remote_gpu};
  std::printf(
      "tcp loopback, %llu B x %zu iovs per call, median of %d runs of %d calls, %d buffer "
      "slice(s) in turn (%.0f MiB per buffer; last-level cache %.0f MiB), %s\n",
      static_cast<unsigned long long>(block), batch, reps, iters, slices,
      static_cast<double>(bytes) / (1 << 20), static_cast<double>(llc) / (1 << 20),
      two_process ? "target in a second process" : "both engines in this process");
  std::printf("%-8s %-12s %-12s %-8s\n", "op", "host GB/s", "GPU GB/s", "GPU/host");
  struct Variant {
    const char* name;
    const Side* side;
  };
  std::vector<Variant> variants = {{"gpu", &gpu}};
  if (mix) {
    variants.push_back({"localgpu-remotehost", &gpu_to_host});
    variants.push_back({"localhost-remotegpu", &host_to_gpu});
  }
  std::vector<int> depths = {1};
  if (depth > 1) depths.push_back(depth);
  for (const Variant& v : variants) {
    for (bool write : {true, false}) {
      if (write && read_only) continue;
      for (int d : depths) {
        std::vector<double> h, g;
        std::map<std::string, double> hcpu, gcpu;
        for (int rep = 0; rep < reps; ++rep) {  // alternate: same conditions for both
          h.push_back(only == "gpu" ? 0.0
                                    : run(*a, peer, host, write, block, batch, iters, d, slices,
                                          cpu ? &hcpu : nullptr));
          g.push_back(only == "host" ? 0.0
                                     : run(*a, peer, *v.side, write, block, batch, iters, d, slices,
                                           cpu ? &gcpu : nullptr));
        }
        std::sort(h.begin(), h.end());
        std::sort(g.begin(), g.end());
        const double hm = h[h.size() / 2], gm = g[g.size() / 2];
        const std::string op = std::string(write ? "write" : "read") +
                               (d > 1 ? " d" + std::to_string(d) : std::string());
        std::printf("%-8s %-12.2f %-12.2f %-8.2f%s\n", op.c_str(), hm, gm, gm / hm,
                    v.side == &gpu ? "" : (std::string("  ") + v.name).c_str());
        std::printf(
            "{\"bench\":\"tcp_gpu\",\"variant\":\"%s\",\"op\":\"%s\",\"depth\":%d,"
            "\"block_size\":%llu,\"batch\":%zu,\"slices\":%d,\"host_gbps\":%.3f,\"gpu_gbps\":%.3f,"
            "\"ratio\":%.3f}\n",
            v.name, write ? "write" : "read", d, static_cast<unsigned long long>(block), batch,
            slices, hm, gm, gm / hm);
        if (cpu) {  // mean over the repetitions, in cores
          std::printf("  cpu (cores):");
          for (const auto* m : {&hcpu, &gcpu}) {
            std::printf(" %s [", m == &hcpu ? "host" : "gpu");
            for (const auto& [name, c] : *m) {
              if (name.ends_with(" sys") || c / reps < 0.01) continue;
              std::printf(" %s=%.2f(sys %.2f)", name.c_str(), c / reps,
                          m->at(name + " sys") / reps);
            }
            std::printf(" ]");
          }
          std::printf("\n");
        }
      }
    }
  }
  cudaFree(gpu_a);
  cudaFree(gpu_b);
  return 0;
}
