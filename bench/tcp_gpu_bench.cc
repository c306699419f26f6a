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
// Both engines run the tcp transport only (engine.transports=tcp): on one host
// the engine would otherwise carry host memory over shm.
// --trace: the stage breakdown instead (tcp.trace, docs/trace.md). Per
// workload (op, block size, local -> remote memory, depth) the median and p90
// of each interval between consecutive stages of a transfer, in us, and of
// posted -> completed; --json adds one JSON line per workload. Its defaults are
// the small-transfer workloads of the issue: --block 4096,65536,262144 (a
// comma list in this mode), --batch 1, all four memory pairs (host->host,
// gpu->gpu, host->gpu, gpu->host), write and read, --depth 8 (blocking and 8
// in flight), --iters 300 calls per workload, one run each (--reps ignored).
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
#include <tuple>
#include <vector>

#include "core/stage_trace.h"
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

// --- --trace ------------------------------------------------------------------

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  return v[k];
}

struct Interval {
  size_t from, to;         // stage indices
  std::vector<double> us;  // one per transfer that has both
};

// For each transfer, the intervals between consecutive stages it has (stage
// order, docs/trace.md), grouped by (from, to); plus posted -> completed.
void print_breakdown(const std::string& title, const std::string& json_head,
                     const std::vector<TraceRecord>& records, bool json) {
  std::vector<Interval> intervals;
  std::vector<double> total;
  size_t failed = 0, out_of_order = 0;
  for (const TraceRecord& r : records) {
    if (r.status != StatusCode::kOk) ++failed;
    if (!trace_order_violations(r).empty()) ++out_of_order;
    size_t prev = kTraceStageCount;
    for (size_t i = 0; i < kTraceStageCount; ++i) {
      if (r.ns[i] == 0) continue;
      if (prev != kTraceStageCount) {
        auto it = std::find_if(intervals.begin(), intervals.end(),
                               [&](const Interval& x) { return x.from == prev && x.to == i; });
        if (it == intervals.end()) it = intervals.insert(intervals.end(), {prev, i, {}});
        it->us.push_back(static_cast<double>(r.ns[i] - r.ns[prev]) / 1e3);
      }
      prev = i;
    }
    if (r.has(TraceStage::kPosted) && r.has(TraceStage::kCompleted)) {
      total.push_back(
          static_cast<double>(r.at(TraceStage::kCompleted) - r.at(TraceStage::kPosted)) / 1e3);
    }
  }
  std::sort(intervals.begin(), intervals.end(), [](const Interval& a, const Interval& b) {
    return std::tie(a.from, a.to) < std::tie(b.from, b.to);
  });
  std::printf("%s: %zu transfers%s%s\n", title.c_str(), records.size(),
              failed ? (", " + std::to_string(failed) + " FAILED").c_str() : "",
              out_of_order
                  ? (", " + std::to_string(out_of_order) + " with stages out of order").c_str()
                  : "");
  std::printf("  %-46s %9s %9s %6s\n", "interval", "p50 us", "p90 us", "n");
  for (const Interval& x : intervals) {
    const std::string name =
        std::string(trace_stage_name(x.from)) + " -> " + std::string(trace_stage_name(x.to));
    std::printf("  %-46s %9.1f %9.1f %6zu\n", name.c_str(), percentile(x.us, 0.5),
                percentile(x.us, 0.9), x.us.size());
  }
  std::printf("  %-46s %9.1f %9.1f %6zu\n", "posted -> completed (total)", percentile(total, 0.5),
              percentile(total, 0.9), total.size());
  if (!json) return;
  std::string line = json_head + ",\"n\":" + std::to_string(records.size()) +
                     ",\"failed\":" + std::to_string(failed) +
                     ",\"out_of_order\":" + std::to_string(out_of_order);
  char buf[256];
  std::snprintf(buf, sizeof buf, ",\"total_us\":{\"p50\":%.2f,\"p90\":%.2f},\"intervals\":[",
                percentile(total, 0.5), percentile(total, 0.9));
  line += buf;
  for (size_t k = 0; k < intervals.size(); ++k) {
    const Interval& x = intervals[k];
    std::snprintf(buf, sizeof buf,
                  "%s{\"from\":\"%s\",\"to\":\"%s\",\"p50_us\":%.2f,\"p90_us\":%.2f,\"n\":%zu}",
                  k ? "," : "", std::string(trace_stage_name(x.from)).c_str(),
                  std::string(trace_stage_name(x.to)).c_str(), percentile(x.us, 0.5),
                  percentile(x.us, 0.9), x.us.size());
    line += buf;
  }
  std::printf("%s]}\n", line.c_str());
}

std::vector<uint64_t> parse_blocks(const std::string& text) {
  std::vector<uint64_t> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    out.push_back(std::stoull(text.substr(pos, comma - pos)));
    pos = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t block = 1 << 20;
  size_t batch = 16;
  int iters = 40, reps = 5, depth = 1, slices = 0;  // 0: twice the last-level cache
  std::string host_alloc = "vector";
  std::string only;  // --only host|gpu: measure one side alone (for a profiler)
  bool mix = false, read_only = false, cpu = false, two_process = false;
  bool trace = false, json = false;
  std::string block_list;  // --block as given (a comma list with --trace)
  bool batch_given = false, iters_given = false, depth_given = false, rotate_given = false;
  auto is_switch = [](const std::string& a) {
    return a == "--mix" || a == "--read-only" || a == "--cpu" || a == "--two-process" ||
           a == "--trace" || a == "--json";
  };
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--two-process") two_process = true;
    if (std::string(argv[i]) == "--mix") mix = true;
    if (std::string(argv[i]) == "--read-only") read_only = true;
    if (std::string(argv[i]) == "--cpu") cpu = true;
    if (std::string(argv[i]) == "--trace") trace = true;
    if (std::string(argv[i]) == "--json") json = true;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (is_switch(a)) {
      --i;
      continue;
    }
    if (a == "--block") block_list = argv[i + 1];
    if (a == "--batch") batch = std::stoull(argv[i + 1]), batch_given = true;
    if (a == "--iters") iters = std::stoi(argv[i + 1]), iters_given = true;
    if (a == "--reps") reps = std::stoi(argv[i + 1]);
    if (a == "--depth") depth = std::max(1, std::stoi(argv[i + 1])), depth_given = true;
    if (a == "--rotate") slices = std::max(1, std::stoi(argv[i + 1])), rotate_given = true;
    if (a == "--host-alloc") host_alloc = argv[i + 1];
    if (a == "--only") only = argv[i + 1];
  }
  // --trace: the small-transfer workloads unless told otherwise.
  std::vector<uint64_t> blocks =
      block_list.empty() ? std::vector<uint64_t>{block} : parse_blocks(block_list);
  if (trace) {
    if (block_list.empty()) blocks = {4096, 65536, 262144};
    if (!batch_given) batch = 1;
    if (!iters_given) iters = 300;
    if (!depth_given) depth = 8;
  } else if (blocks.size() != 1) {
    std::printf("--block takes one size (a comma list only with --trace)\n");
    return 2;
  }
  block = *std::max_element(blocks.begin(), blocks.end());
  std::string reason;
  // Without a GPU only the host-memory breakdown can run (--trace --only host,
  // both engines in this process): the trace's own check on a CPU machine.
  const bool have_gpu = cuda_available(&reason);
  if (!have_gpu && !(trace && only == "host" && !two_process)) {
    std::printf("skipped: %s\n", reason.c_str());
    return 0;
  }
  const size_t llc = last_level_cache_bytes();
  if (slices == 0) {
    const size_t call_bytes = block * batch;
    slices = static_cast<int>(std::max<size_t>(1, (2 * llc + call_bytes - 1) / call_bytes));
  }
  const size_t bytes = block * batch * slices;
  // tcp only: on one host the engine would carry host memory over shm.
  EngineConfig config;
  config.options["engine.transports"] = "tcp";
  EngineConfig traced = config;
  if (trace) {
    traced.options["tcp.trace"] = "true";
    traced.options["tcp.trace_keep"] = std::to_string(std::max(4096, iters + 64));
  }
  auto a = Engine::create(traced).value();
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
  if (have_gpu) {
    cudaSetDevice(0);
    if (cudaMalloc(&gpu_a, bytes) != cudaSuccess ||
        (!two_process && cudaMalloc(&gpu_b, bytes) != cudaSuccess)) {
      std::printf("cudaMalloc failed\n");
      return 1;
    }
    cudaMemset(gpu_a, 1, bytes);
    a->register_memory(gpu_a, bytes).value();
  }
  a->register_memory(host_a.data(), bytes).value();
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
    b = Engine::create(config).value();
    auto rhb = b->register_memory(host_b.data(), bytes).value();
    peer = a->connect(b->metadata()).value();
    remote_host = b->advertise(rhb.id).value();
    if (have_gpu) remote_gpu = b->advertise(b->register_memory(gpu_b, bytes).value().id).value();
  }
  const Side host{host_a.data(), remote_host};
  const Side gpu{static_cast<uint8_t*>(gpu_a), remote_gpu};
  const Side gpu_to_host{static_cast<uint8_t*>(gpu_a), remote_host};
  const Side host_to_gpu{host_a.data(), remote_gpu};
  if (trace) {
    std::printf(
        "stage trace over tcp loopback (%s), %zu iov(s) per call, %d calls per workload after 3 "
        "warm-up calls, buffers of %.0f MiB in turn; intervals between consecutive stages "
        "(docs/trace.md), us\n",
        two_process ? "target in a second process" : "both engines in this process", batch, iters,
        static_cast<double>(bytes) / (1 << 20));
    struct Pair {
      const char *local, *remote;
      const Side* side;
    };
    std::vector<Pair> pairs;
    if (only != "gpu") pairs.push_back({"host", "host", &host});
    if (only != "host") {
      pairs.push_back({"gpu", "gpu", &gpu});
      pairs.push_back({"host", "gpu", &host_to_gpu});
      pairs.push_back({"gpu", "host", &gpu_to_host});
    }
    std::vector<int> trace_depths = {1};
    if (depth > 1) trace_depths.push_back(depth);
    for (uint64_t b_size : blocks) {
      const int b_slices =
          rotate_given ? slices : static_cast<int>(std::max<size_t>(1, bytes / (b_size * batch)));
      for (const Pair& pr : pairs) {
        for (bool write : {true, false}) {
          if (write && read_only) continue;
          for (int d : trace_depths) {
            (void)take_engine_traces(a->id());
            run(*a, peer, *pr.side, write, b_size, batch, iters, d, b_slices, nullptr);
            auto records = take_engine_traces(a->id());
            if (records.size() > static_cast<size_t>(iters)) {  // the warm-up calls first
              records.erase(records.begin(), records.end() - static_cast<std::ptrdiff_t>(iters));
            }
            const char* op = write ? "write" : "read";
            char title[160], head[320];
            std::snprintf(title, sizeof title, "%s %s->%s %llu B x%zu depth %d", op, pr.local,
                          pr.remote, static_cast<unsigned long long>(b_size), batch, d);
            std::snprintf(head, sizeof head,
                          "{\"bench\":\"tcp_gpu_trace\",\"op\":\"%s\",\"local\":\"%s\","
                          "\"remote\":\"%s\",\"block_size\":%llu,\"batch\":%zu,\"depth\":%d,"
                          "\"two_process\":%s",
                          op, pr.local, pr.remote, static_cast<unsigned long long>(b_size), batch,
                          d, two_process ? "true" : "false");
            print_breakdown(title, head, records, json);
          }
        }
      }
    }
    if (have_gpu) {
      cudaFree(gpu_a);
      cudaFree(gpu_b);
    }
    return 0;
  }
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
