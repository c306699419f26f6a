// GPU memory over the fabric transport (libfabric; tcp;ofi_rxm unless
// FERRY_FABRIC_PROVIDER says otherwise), between two real processes: the
// target is ferry_tcp_gpu_peer (one GPU and one host buffer, advertised).
// Without FI_HMEM (tcp;ofi_rxm has none) local GPU memory is staged through
// the pinned slots of transport/common/gpu_staging.h: WRITE and READ, local
// GPU <-> remote host, 4 KiB to 16 MiB and batches of many blocks, random
// data, every byte checked. The peer's GPU memory cannot be reached
// one-sided then: with tcp running it goes over tcp, with fabric alone the
// call is refused naming the reason. Skips, with the reason, where no CUDA
// device answers or the fabric transport cannot start (no libfabric).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <string>
#include <vector>

#include "ferry/engine.h"
#include "ferry/gpu.h"
#include "target_process.h"
#include "tcp_gpu_common.h"

namespace ferry {
namespace {

constexpr size_t kRemoteSize = 48u << 20;
constexpr size_t kLocalSize = 64u << 20;

std::string peer_program() {
  return gputest::peer_program(FERRY_TCP_GPU_PEER);
}

// Both processes read the transports and the provider from the environment.
class FabricGpuMemory : public ::testing::Test {
 protected:
  void start(const char* transports) {
    std::string reason;
    if (!cuda_available(&reason)) GTEST_SKIP() << "skipped: " << reason;
    setenv("FERRY_ENGINE_TRANSPORTS", transports, 1);
    setenv("FERRY_FABRIC_PROVIDER", "tcp;ofi_rxm", 0);  // a set value wins
    auto e = Engine::create();
    if (!e.ok())
      GTEST_SKIP() << "skipped: the fabric transport cannot start here: " << e.status().to_string();
    engine_ = std::move(e.value());
    std::string error;
    ASSERT_TRUE(target_.start(peer_program(), kRemoteSize, &error)) << error;
    auto f = target_.ready_fields();
    ASSERT_EQ(f.size(), 4u);
    auto peer = engine_->connect(gputest::unhex(f[1]));
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    peer_ = *peer;
    remote_gpu_ = RemoteDescriptor::from_bytes(gputest::unhex(f[2])).value();
    remote_host_ = RemoteDescriptor::from_bytes(gputest::unhex(f[3])).value();
    ASSERT_EQ(remote_gpu_.kind, MemoryKind::kCuda);
    ASSERT_EQ(cudaMalloc(&local_gpu_, kLocalSize), cudaSuccess);
    auto rg = engine_->register_memory(local_gpu_, kLocalSize);
    ASSERT_TRUE(rg.ok()) << rg.status().to_string();
    ASSERT_EQ(rg->kind, MemoryKind::kCuda);
    for (const auto& t : engine_->transports()) {
      std::printf("transport %s: %s\n", t.name.c_str(), t.detail.c_str());
    }
  }
  void TearDown() override {
    engine_.reset();
    if (local_gpu_) cudaFree(local_gpu_);
    unsetenv("FERRY_ENGINE_TRANSPORTS");
  }
  std::string carrier_of_local_gpu() {
    auto infos = engine_->peer_transports(peer_);
    if (!infos.ok()) return "?";
    for (const auto& i : *infos) {
      std::printf("peer transport %s: carries [%s] reason [%s]\n", i.transport.c_str(),
                  i.carries.c_str(), i.reason.c_str());
      if (i.carries.find("local GPU with peer host memory") != std::string::npos) {
        return i.transport;
      }
    }
    return "none";
  }

  // `batch` blocks of `block` bytes, scattered locally (5-byte gaps),
  // contiguous on the target; the target's `which` buffer ("gpu"/"host").
  void run(bool write, bool remote_gpu, uint64_t block, size_t batch, uint64_t seed) {
    SCOPED_TRACE(std::string(write ? "write" : "read") + " gpu<->" +
                 (remote_gpu ? "gpu " : "host ") + std::to_string(block) + "B x" +
                 std::to_string(batch));
    const uint64_t stride = block + 5;
    const uint64_t local_span = stride * batch;
    const uint64_t remote_span = block * batch;
    ASSERT_LE(local_span, kLocalSize);
    ASSERT_LE(remote_span + 64, kRemoteSize);
    const RemoteDescriptor& remote = remote_gpu ? remote_gpu_ : remote_host_;
    std::vector<LocalIov> l(batch);
    std::vector<RemoteIov> r(batch);
    for (size_t i = 0; i < batch; ++i) {
      l[i] = {static_cast<uint8_t*>(local_gpu_) + i * stride, block};
      r[i] = {&remote, i * block, block};
    }
    ASSERT_EQ(target_.ask("fill " + std::to_string(seed)), "ok");
    std::vector<uint8_t> remote_image(kRemoteSize);
    gputest::fill(remote_image.data(), kRemoteSize, remote_gpu ? seed : seed + 1);
    std::vector<uint8_t> local_image(local_span);
    gputest::fill(local_image.data(), local_span, seed * 7 + 3);
    ASSERT_EQ(cudaMemcpy(local_gpu_, local_image.data(), local_span, cudaMemcpyHostToDevice),
              cudaSuccess);
    const std::string which = remote_gpu ? "gpu" : "host";
    if (write) {
      Status s = engine_->write(peer_, l, r);
      ASSERT_TRUE(s.ok()) << s.to_string();
      std::vector<uint8_t> expect(remote_span);
      for (size_t i = 0; i < batch; ++i) {
        std::memcpy(expect.data() + i * block, local_image.data() + i * stride, block);
      }
      EXPECT_EQ(target_.ask("sum " + which + " 0 " + std::to_string(remote_span)),
                "sum " + std::to_string(gputest::fnv(expect.data(), remote_span)))
          << "remote bytes differ from what was written";
      EXPECT_EQ(target_.ask("sum " + which + " " + std::to_string(remote_span) + " 64"),
                "sum " + std::to_string(gputest::fnv(remote_image.data() + remote_span, 64)))
          << "bytes past the written range changed";
    } else {
      Status s = engine_->read(peer_, l, r);
      ASSERT_TRUE(s.ok()) << s.to_string();
      std::vector<uint8_t> got(local_span);
      ASSERT_EQ(cudaMemcpy(got.data(), local_gpu_, local_span, cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (size_t i = 0; i < batch; ++i) {
        ASSERT_EQ(0, std::memcmp(remote_image.data() + i * block, got.data() + i * stride, block))
            << "block " << i << " differs";
        if (i + 1 < batch) {
          ASSERT_EQ(0, std::memcmp(local_image.data() + i * stride + block,
                                   got.data() + i * stride + block, 5))
              << "gap after block " << i << " was overwritten";
        }
      }
    }
  }

  gputest::TargetProcess target_;
  std::unique_ptr<Engine> engine_;
  PeerId peer_ = 0;
  RemoteDescriptor remote_gpu_, remote_host_;
  void* local_gpu_ = nullptr;
};

TEST_F(FabricGpuMemory, LocalGpuWithPeerHostMemoryEverySizeAndBatch) {
  start("fabric");
  if (IsSkipped() || HasFatalFailure()) return;
  EXPECT_EQ(carrier_of_local_gpu(), "fabric");
  // 4 KiB .. 16 MiB single blocks (16 MiB: 16 slots, pipelined), then
  // batches: many small blocks packed into slots, blocks across slot edges.
  const std::vector<std::pair<uint64_t, size_t>> shapes = {
      {4u << 10, 1},    {64u << 10, 1}, {1u << 20, 1},         {16u << 20, 1},
      {4u << 10, 4096}, {513, 300},     {(64u << 10) + 1, 40}, {(1u << 20) + 3, 3}};
  uint64_t seed = 101;
  for (bool write : {true, false}) {
    for (auto [block, batch] : shapes) {
      run(write, false, block, batch, ++seed);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(FabricGpuMemory, LargerThanTheStagingPoolFlowsThrough) {
  // 40 MiB through a 4 MiB pool: slots go back as their bytes complete.
  setenv("FERRY_FABRIC_GPU_STAGING_BYTES", "4MiB", 1);
  start("fabric");
  unsetenv("FERRY_FABRIC_GPU_STAGING_BYTES");
  if (IsSkipped() || HasFatalFailure()) return;
  run(true, false, 40u << 20, 1, 7);
  run(false, false, 40u << 20, 1, 8);
}

TEST_F(FabricGpuMemory, PeerGpuMemoryWithoutHmemIsRefusedClearly) {
  start("fabric");
  if (IsSkipped() || HasFatalFailure()) return;
  std::vector<LocalIov> l = {{local_gpu_, 4096}};
  std::vector<RemoteIov> r = {{&remote_gpu_, 0, 4096}};
  Status s = engine_->write(peer_, l, r);
  if (s.ok()) GTEST_SKIP() << "the provider offers FI_HMEM on both sides: nothing to refuse";
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.to_string();
  EXPECT_NE(s.message().find("peer GPU memory"), std::string::npos) << s.to_string();
  auto infos = engine_->peer_transports(peer_);
  ASSERT_TRUE(infos.ok());
  bool said = false;
  for (const auto& i : *infos) {
    if (i.transport == "fabric") said = i.reason.find("FI_HMEM") != std::string::npos;
  }
  EXPECT_TRUE(said) << "peer_transports() does not say why fabric cannot reach peer GPU memory";
}

TEST_F(FabricGpuMemory, PeerGpuMemoryGoesOverTcpWhenBothRun) {
  start("fabric,tcp");
  if (IsSkipped() || HasFatalFailure()) return;
  EXPECT_EQ(carrier_of_local_gpu(), "fabric");
  run(true, true, 1u << 20, 4, 31);  // peer GPU memory: tcp (fabric without FI_HMEM)
  run(false, true, 64u << 10, 16, 32);
  run(true, false, 1u << 20, 4, 33);  // local GPU, peer host: fabric
}

}  // namespace
}  // namespace ferry
