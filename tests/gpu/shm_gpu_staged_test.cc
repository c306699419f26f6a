// GPU memory between two processes of one host through shm's staging areas
// (engine.gpu_same_host_path=shm_staged, and auto where cuda_ipc does not
// run): writes and reads, host->GPU, GPU->host and GPU->GPU, scattered
// batches, transfers larger than the staging area, random data, every byte
// verified (the target's memory by the target process itself, ferry_tcp_gpu_peer).
// Also each forced path (cuda_ipc, tcp) carrying GPU memory, and what
// peer_transports() says. Skips, with the reason, where no CUDA device answers.
//
// ctest names: gpu.ShmGpuStaged.* (both processes on GPU 0),
// gpu.two_gpus.ShmGpuStaged.* (the target on GPU 1, both visible), and
// gpu.one_gpu_each.ShmGpuStaged.* (each process sees only its own GPU).
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ferry/engine.h"
#include "ferry/gpu.h"
#include "gpu_test_util.h"
#include "target_process.h"
#include "tcp_gpu_common.h"

namespace ferry {
namespace {

constexpr size_t kRemoteSize = 48u << 20;
constexpr size_t kLocalSize = 64u << 20;

// FERRY_TEST_ONE_GPU_EACH=A,B: this process sees GPU A only, the target GPU
// B only; applied before main(), before CUDA reads CUDA_VISIBLE_DEVICES.
[[maybe_unused]] const bool kOneGpuEachApplied = [] {
  const char* v = std::getenv("FERRY_TEST_ONE_GPU_EACH");
  const std::string s = v != nullptr ? v : "";
  const size_t comma = s.find(',');
  if (comma == std::string::npos) return false;
  setenv("CUDA_VISIBLE_DEVICES", s.substr(0, comma).c_str(), 1);
  setenv("FERRY_TEST_PEER_VISIBLE_DEVICES", s.substr(comma + 1).c_str(), 1);
  return true;
}();

int host_gpu_count() {
  int n = 0;
  if (DIR* d = opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

struct Case {
  bool local_gpu, remote_gpu, write;
  uint64_t block;
  size_t batch;
};

std::string name(const Case& c) {
  return std::string(c.write ? "write " : "read ") + (c.local_gpu ? "gpu" : "host") + "->" +
         (c.remote_gpu ? "gpu" : "host") + " " + std::to_string(c.block) + "B x" +
         std::to_string(c.batch);
}

class ShmGpuStaged : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    if (!cuda_available(&reason)) GTEST_SKIP() << "skipped: " << reason;
    if (gputest::peer_device() >= cuda_device_count()) {
      GTEST_SKIP() << "skipped: the target process is to use GPU " << gputest::peer_device()
                   << " (FERRY_TEST_PEER_DEVICE), this machine has " << cuda_device_count();
    }
    const char* v = std::getenv("FERRY_TEST_PEER_VISIBLE_DEVICES");
    peer_visible_ = v != nullptr ? v : "";
    if (!peer_visible_.empty() && host_gpu_count() == 1) {
      GTEST_SKIP() << "skipped: one GPU per process needs two GPUs on this host";
    }
  }
  void TearDown() override {
    engine_.reset();
    if (local_gpu_) cudaFree(local_gpu_);
    local_gpu_ = nullptr;
  }

  // Starts the target and this engine with `options` (the target gets them
  // through the environment: FERRY_<OPTION>).
  void start(const std::map<std::string, std::string>& options) {
    for (const auto& [k, val] : options) setenv(option_env(k).c_str(), val.c_str(), 1);
    const char* mine = std::getenv("CUDA_VISIBLE_DEVICES");
    const std::string saved = mine != nullptr ? mine : "";
    if (!peer_visible_.empty()) setenv("CUDA_VISIBLE_DEVICES", peer_visible_.c_str(), 1);
    std::string error;
    const bool started =
        target_->start(gputest::peer_program(FERRY_TCP_GPU_PEER), kRemoteSize, &error);
    if (!peer_visible_.empty()) {
      if (mine != nullptr) {
        setenv("CUDA_VISIBLE_DEVICES", saved.c_str(), 1);
      } else {
        unsetenv("CUDA_VISIBLE_DEVICES");
      }
    }
    for (const auto& [k, val] : options) unsetenv(option_env(k).c_str());
    ASSERT_TRUE(started) << error;
    auto f = target_->ready_fields();
    ASSERT_EQ(f.size(), 4u);
    EngineConfig config;
    config.options = options;
    auto e = Engine::create(config);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    engine_ = std::move(e.value());
    auto peer = engine_->connect(gputest::unhex(f[1]));
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    peer_ = *peer;
    remote_gpu_ = RemoteDescriptor::from_bytes(gputest::unhex(f[2])).value();
    remote_host_ = RemoteDescriptor::from_bytes(gputest::unhex(f[3])).value();
    ASSERT_EQ(remote_gpu_.kind, MemoryKind::kCuda);
    ASSERT_EQ(cudaMalloc(&local_gpu_, kLocalSize), cudaSuccess);
    local_host_.resize(kLocalSize);
    auto rg = engine_->register_memory(local_gpu_, kLocalSize);
    ASSERT_TRUE(rg.ok()) << rg.status().to_string();
    ASSERT_TRUE(engine_->register_memory(local_host_.data(), kLocalSize).ok());
  }

  static std::string option_env(const std::string& option) {
    std::string e = "FERRY_";
    for (char ch : option) e += ch == '.' ? '_' : static_cast<char>(std::toupper(ch));
    return e;
  }

  // The transport entry of peer_transports() for `transport`.
  PeerTransportInfo info(const std::string& transport) {
    auto all = engine_->peer_transports(peer_);
    EXPECT_TRUE(all.ok());
    for (const auto& i : *all) {
      if (i.transport == transport) return i;
    }
    ADD_FAILURE() << "no entry for " << transport;
    return {};
  }

  void run(const Case& c, uint64_t seed) {
    SCOPED_TRACE(name(c));
    const uint64_t stride = c.block + 5;  // scattered locally, contiguous remotely
    const uint64_t local_span = stride * c.batch;
    const uint64_t remote_span = c.block * c.batch;
    ASSERT_LE(local_span, kLocalSize);
    ASSERT_LE(remote_span + 64, kRemoteSize);
    uint8_t* local_base = c.local_gpu ? static_cast<uint8_t*>(local_gpu_) : local_host_.data();
    const RemoteDescriptor& remote = c.remote_gpu ? remote_gpu_ : remote_host_;
    std::vector<LocalIov> l(c.batch);
    std::vector<RemoteIov> r(c.batch);
    for (size_t i = 0; i < c.batch; ++i) {
      l[i] = {local_base + i * stride, c.block};
      r[i] = {&remote, i * c.block, c.block};
    }
    ASSERT_EQ(target_->ask("fill " + std::to_string(seed)), "ok");
    std::vector<uint8_t> remote_image(kRemoteSize);
    gputest::fill(remote_image.data(), kRemoteSize, c.remote_gpu ? seed : seed + 1);
    std::vector<uint8_t> local_image(local_span);
    gputest::fill(local_image.data(), local_span, seed * 7 + 3);
    if (c.local_gpu) {
      ASSERT_EQ(cudaMemcpy(local_gpu_, local_image.data(), local_span, cudaMemcpyHostToDevice),
                cudaSuccess);
    } else {
      std::copy(local_image.begin(), local_image.end(), local_host_.begin());
    }
    const char* which = c.remote_gpu ? "gpu" : "host";
    if (c.write) {
      Status s = engine_->write(peer_, l, r);
      ASSERT_TRUE(s.ok()) << s.to_string();
      std::vector<uint8_t> expect(remote_span);
      for (size_t i = 0; i < c.batch; ++i) {
        std::copy_n(local_image.begin() + static_cast<long>(i * stride), c.block,
                    expect.begin() + static_cast<long>(i * c.block));
      }
      EXPECT_EQ(target_->ask("sum " + std::string(which) + " 0 " + std::to_string(remote_span)),
                "sum " + std::to_string(gputest::fnv(expect.data(), remote_span)))
          << "remote bytes differ from what was written";
      EXPECT_EQ(
          target_->ask("sum " + std::string(which) + " " + std::to_string(remote_span) + " 64"),
          "sum " + std::to_string(gputest::fnv(remote_image.data() + remote_span, 64)))
          << "bytes past the written range changed";
    } else {
      Status s = engine_->read(peer_, l, r);
      ASSERT_TRUE(s.ok()) << s.to_string();
      std::vector<uint8_t> got(local_span);
      if (c.local_gpu) {
        ASSERT_EQ(cudaMemcpy(got.data(), local_gpu_, local_span, cudaMemcpyDeviceToHost),
                  cudaSuccess);
      } else {
        std::copy_n(local_host_.begin(), local_span, got.begin());
      }
      for (size_t i = 0; i < c.batch; ++i) {
        ASSERT_EQ(0,
                  std::memcmp(remote_image.data() + i * c.block, got.data() + i * stride, c.block))
            << "block " << i << " differs";
        if (i + 1 < c.batch) {
          ASSERT_EQ(0, std::memcmp(local_image.data() + i * stride + c.block,
                                   got.data() + i * stride + c.block, 5))
              << "gap after block " << i << " was overwritten";
        }
      }
    }
  }

  // Every direction, writes and reads, over the shapes.
  void every_direction(const std::vector<std::pair<uint64_t, size_t>>& shapes) {
    uint64_t seed = 31;
    for (bool write : {true, false}) {
      for (int kinds = 1; kinds < 4; ++kinds) {  // host->gpu, gpu->host, gpu->gpu
        for (auto [block, batch] : shapes) {
          run({(kinds & 1) != 0, (kinds & 2) != 0, write, block, batch}, ++seed);
          if (HasFatalFailure()) return;
        }
      }
    }
  }

  std::string peer_visible_;
  std::unique_ptr<gputest::TargetProcess> target_ = std::make_unique<gputest::TargetProcess>();
  std::unique_ptr<Engine> engine_;
  PeerId peer_ = 0;
  RemoteDescriptor remote_gpu_, remote_host_;
  void* local_gpu_ = nullptr;
  std::vector<uint8_t> local_host_;
};

// 1 MiB + 3 and 16 MiB + 1 blocks: larger than a request, and (x2) larger
// than the 32 MiB staging area, so requests wait for ranges to come back.
const std::vector<std::pair<uint64_t, size_t>> kShapes = {
    {1, 1},      {4097, 7},           {4096, 1024},        {513, 300},
    {65537, 40}, {(1u << 20) + 3, 3}, {(16u << 20) + 1, 2}};

TEST_F(ShmGpuStaged, ForcedEveryDirectionBesideCrossMemoryAttach) {
  start({{"engine.gpu_same_host_path", "shm_staged"}});
  if (HasFatalFailure()) return;
  const PeerTransportInfo shm = info("shm");
  EXPECT_NE(shm.carries.find("peer GPU memory"), std::string::npos) << shm.carries;
  EXPECT_NE(shm.carries.find("local GPU with peer host memory"), std::string::npos);
  EXPECT_NE(shm.via.find("engine.gpu_same_host_path=shm_staged"), std::string::npos) << shm.via;
  every_direction(kShapes);
}

TEST_F(ShmGpuStaged, ForcedEveryDirectionInStagingMode) {
  start({{"engine.gpu_same_host_path", "shm_staged"}, {"shm.mode", "staging"}});
  if (HasFatalFailure()) return;
  EXPECT_NE(info("shm").carries.find("peer GPU memory"), std::string::npos);
  every_direction({{4096, 1024}, {(1u << 20) + 3, 3}, {(16u << 20) + 1, 2}});
}

TEST_F(ShmGpuStaged, AutoStagesWhenCudaIpcDoesNotRunNeverTcp) {
  start({{"engine.transports", "shm,tcp"}});
  if (HasFatalFailure()) return;
  const PeerTransportInfo shm = info("shm");
  EXPECT_NE(shm.carries.find("peer GPU memory"), std::string::npos) << shm.carries;
  EXPECT_NE(shm.via.find("cuda_ipc does not run here"), std::string::npos) << shm.via;
  const PeerTransportInfo tcp = info("tcp");
  EXPECT_EQ(tcp.carries.find("GPU"), std::string::npos) << tcp.carries;
  every_direction({{4096, 64}, {(1u << 20) + 3, 3}});
}

TEST_F(ShmGpuStaged, EachForcedPathCarriesGpuMemory) {
  for (const char* path : {"cuda_ipc", "tcp"}) {
    SCOPED_TRACE(path);
    TearDown();
    target_ = std::make_unique<gputest::TargetProcess>();
    start({{"engine.gpu_same_host_path", path}});
    if (HasFatalFailure()) return;
    const PeerTransportInfo chosen = info(path);
    EXPECT_NE(chosen.carries.find("peer GPU memory"), std::string::npos) << chosen.carries;
    EXPECT_EQ(info("shm").carries.find("GPU"), std::string::npos);
    every_direction({{4096, 64}, {(1u << 20) + 3, 2}});
  }
}

}  // namespace
}  // namespace ferry
