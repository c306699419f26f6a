// The device API's floors on two GPUs, two member processes (forked; the
// cards go through the parent): put + signal ping-pong latency (8 bytes, one
// way = half a round trip, timed by %globaltimer inside the kernel), and put
// bandwidth (put_block from every block, GPU 0 -> GPU 1) against one
// contiguous copy-engine copy (cudaMemcpyAsync into the same mapped peer
// buffer) of the same bytes, alternating, medians of the repetitions.
// Prints a table and, with --json FILE, one JSON object per line.
//   ferry-device-api-bench [--json FILE] [--reps N]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/device.cuh"
#include "ferry/symmetric.h"
#include "member_group.h"

namespace dev = ferry::device;

namespace {

constexpr int kPingIters = 20000, kPingWarmup = 2000;

// Member 0 puts 8 bytes and signals round i; member 1 waits for i, puts 8
// bytes back and signals i; member 0 waits. times[i] = round trip i (ns).
__global__ void ping_pong(ferry::DeviceTeam team, const uint64_t* payload, uint64_t* times,
                          int iters) {
  const int peer = 1 - team.rank;
  for (int i = 1; i <= iters; ++i) {
    if (team.rank == 0) {
      const uint64_t t0 = dev::globaltimer_ns();
      dev::put_thread(team, peer, 0, payload, 8);
      dev::signal(team, peer, 0, static_cast<uint64_t>(i));
      dev::wait(team, 0, static_cast<uint64_t>(i));
      times[i - 1] = dev::globaltimer_ns() - t0;
    } else {
      dev::wait(team, 0, static_cast<uint64_t>(i));
      dev::put_thread(team, peer, 0, payload, 8);
      dev::signal(team, peer, 0, static_cast<uint64_t>(i));
    }
  }
}

__global__ void put_kernel(ferry::DeviceTeam team, int peer, const uint8_t* src, uint64_t bytes) {
  // Each block takes a contiguous share (16-byte multiples), put_block within it.
  const uint64_t vectors = bytes / 16;
  const uint64_t per = (vectors + gridDim.x - 1) / gridDim.x;
  const uint64_t first = per * blockIdx.x;
  if (first >= vectors) return;
  const uint64_t n = per < vectors - first ? per : vectors - first;
  dev::put_block(team, peer, first * 16, src + first * 16, n * 16);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

std::string run(gputest::Member& m, int reps, FILE* json) {
  int n = 0;
  cudaGetDeviceCount(&n);
  if (n < 2) return "SKIP: 2 GPUs needed, " + std::to_string(n) + " visible";
  cudaSetDevice(m.rank());
  constexpr uint64_t kMaxBytes = 1ull << 30;
  ferry::SymmetricOptions o;
  o.device = m.rank();
  o.rank = m.rank();
  o.size = m.size();
  o.data_bytes = kMaxBytes;
  auto made = ferry::SymmetricMemory::create(o);
  if (!made.ok()) return "create: " + made.status().message();
  auto& mem = *made;
  if (auto s = mem->join(m.all_gather(mem->card())); !s.ok()) return "join: " + s.message();
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  uint8_t* src = nullptr;
  cudaMalloc(&src, kMaxBytes);
  cudaMemset(src, 0x3c, kMaxBytes);
  uint64_t* times = nullptr;
  cudaMalloc(&times, sizeof(uint64_t) * (kPingIters + kPingWarmup));
  cudaDeviceSynchronize();
  m.barrier();

  // 1. ping-pong.
  ping_pong<<<1, 1, 0, stream>>>(mem->team(), reinterpret_cast<const uint64_t*>(src), times,
                                 kPingIters + kPingWarmup);
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) {
    return std::string("ping-pong: ") + cudaGetErrorString(e);
  }
  if (auto s = mem->device_error(); !s.ok()) return "ping-pong: " + s.message();
  if (m.rank() == 0) {
    std::vector<uint64_t> t(kPingIters + kPingWarmup);
    cudaMemcpy(t.data(), times, t.size() * 8, cudaMemcpyDeviceToHost);
    std::vector<double> one_way;
    for (int i = kPingWarmup; i < kPingIters + kPingWarmup; ++i) one_way.push_back(t[i] / 2000.0);
    const double p50 = median(one_way), p99 = percentile(one_way, 0.99);
    std::printf(
        "put+signal 8 B, one way (half a round trip), %d rounds: p50 %.2f us, p99 %.2f us\n",
        kPingIters, p50, p99);
    if (json != nullptr) {
      std::fprintf(json,
                   "{\"bench\":\"ping_pong\",\"bytes\":8,\"rounds\":%d,\"one_way_p50_us\":%.3f,"
                   "\"one_way_p99_us\":%.3f}\n",
                   kPingIters, p50, p99);
    }
  }
  m.barrier();

  // 2. put bandwidth, member 0 -> member 1, against one copy-engine copy.
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, m.rank());
  if (m.rank() == 0) {
    std::printf("\n%-12s %-8s %14s %14s %8s\n", "bytes", "blocks", "put GB/s", "copy GB/s",
                "ratio");
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    void* dst = mem->peer_data(1);
    for (uint64_t bytes : {1ull << 20, 16ull << 20, 256ull << 20, 1ull << 30}) {
      for (int blocks : {8, 32, sms}) {
        std::vector<double> put_gbs, copy_gbs;
        for (int r = 0; r < reps + 1; ++r) {  // the first is a warm-up
          float ms = 0;
          cudaEventRecord(a, stream);
          put_kernel<<<blocks, 512, 0, stream>>>(mem->team(), 1, src, bytes);
          cudaEventRecord(b, stream);
          cudaEventSynchronize(b);
          cudaEventElapsedTime(&ms, a, b);
          if (r > 0) put_gbs.push_back(bytes / (ms * 1e6));
          cudaEventRecord(a, stream);
          cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
          cudaEventRecord(b, stream);
          cudaEventSynchronize(b);
          cudaEventElapsedTime(&ms, a, b);
          if (r > 0) copy_gbs.push_back(bytes / (ms * 1e6));
        }
        const double p = median(put_gbs), c = median(copy_gbs);
        std::printf("%-12llu %-8d %14.1f %14.1f %8.2f\n", static_cast<unsigned long long>(bytes),
                    blocks, p, c, p / c);
        if (json != nullptr) {
          std::fprintf(json,
                       "{\"bench\":\"put_bandwidth\",\"bytes\":%llu,\"blocks\":%d,\"threads\":512,"
                       "\"put_gbs\":%.2f,\"copy_engine_gbs\":%.2f,\"ratio\":%.3f,\"reps\":%d}\n",
                       static_cast<unsigned long long>(bytes), blocks, p, c, p / c, reps);
        }
      }
    }
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
      return std::string("bandwidth: ") + cudaGetErrorString(e);
    }
    if (auto s = mem->device_error(); !s.ok()) return "bandwidth: " + s.message();
  }
  m.barrier();
  cudaFree(src);
  cudaFree(times);
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 7;
  const char* json_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc)
      json_path = argv[++i];
    else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--json FILE] [--reps N]\n", argv[0]);
      return 2;
    }
  }
  const auto reports = gputest::run_members(2, [&](gputest::Member& m) {
    FILE* json = nullptr;
    if (json_path != nullptr && m.rank() == 0) json = std::fopen(json_path, "a");
    std::string r = run(m, reps, json);
    if (json != nullptr) std::fclose(json);
    std::fflush(stdout);
    return r;
  });
  int rc = 0;
  for (size_t i = 0; i < reports.size(); ++i) {
    if (!reports[i].empty()) {
      std::fprintf(stderr, "member %zu: %s\n", i, reports[i].c_str());
      rc = reports[i].rfind("SKIP:", 0) == 0 ? rc : 1;
    }
  }
  return rc;
}
