// GPU memory over the tcp transport, between two real processes on loopback:
// every direction of {host, GPU} × {host, GPU} for WRITE and READ, several
// block sizes and batch sizes, random data, poisoned destinations, every byte
// verified (the target's memory is checked by the target process itself).
// Skips, with the reason, where no CUDA device answers.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/stage_trace.h"
#include "ferry/engine.h"
#include "ferry/gpu.h"
#include "gpu_test_util.h"
#include "target_process.h"
#include "tcp_gpu_common.h"
#include "trace_expect.h"

namespace ferry {
namespace {

// tcp is what this suite is about: on one host the engines (this process and
// the target it starts, which inherits the variable) would otherwise move peer
// GPU memory over cuda_ipc. Set here rather than in ctest's ENVIRONMENT, which
// gtest_discover_tests (CMake 3.25) cuts to its first variable: the two-GPU
// suite needs FERRY_TEST_PEER_DEVICE there.
const bool kTcpForced = setenv("FERRY_ENGINE_TRANSPORTS", "tcp", 1) == 0;

constexpr size_t kRemoteSize = 48u << 20;
constexpr size_t kLocalSize = 64u << 20;

// The target program: $FERRY_TCP_GPU_PEER, else beside this test's own
// executable (a copied test tree), else the build that compiled this test.
std::string peer_program() {
  return gputest::peer_program(FERRY_TCP_GPU_PEER);
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

class TcpGpuMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    if (!cuda_available(&reason)) GTEST_SKIP() << "skipped: " << reason;
    if (gputest::peer_device() >= cuda_device_count()) {
      GTEST_SKIP() << "skipped: the target process is to use GPU " << gputest::peer_device()
                   << " (FERRY_TEST_PEER_DEVICE), this machine has " << cuda_device_count();
    }
    std::string error;
    ASSERT_TRUE(target_.start(peer_program(), kRemoteSize, &error)) << error;
    auto f = target_.ready_fields();
    ASSERT_EQ(f.size(), 4u);
    auto e = Engine::create();
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
    ASSERT_EQ(rg->kind, MemoryKind::kCuda);
    ASSERT_TRUE(engine_->register_memory(local_host_.data(), kLocalSize).ok());
  }
  void TearDown() override {
    engine_.reset();
    if (local_gpu_) cudaFree(local_gpu_);
  }

  // Local memory image <-> the local buffer of the case's kind.
  void put_local(const Case& c, const std::vector<uint8_t>& image) {
    if (c.local_gpu) {
      ASSERT_EQ(cudaMemcpy(local_gpu_, image.data(), image.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
    } else {
      std::copy(image.begin(), image.end(), local_host_.begin());
    }
  }
  std::vector<uint8_t> get_local(const Case& c, size_t n) {
    std::vector<uint8_t> out(n);
    if (c.local_gpu) {
      EXPECT_EQ(cudaMemcpy(out.data(), local_gpu_, n, cudaMemcpyDeviceToHost), cudaSuccess);
    } else {
      std::copy(local_host_.begin(), local_host_.begin() + static_cast<long>(n), out.begin());
    }
    return out;
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
    // The target fills its GPU buffer with pattern(seed), host with pattern(seed+1).
    ASSERT_EQ(target_.ask("fill " + std::to_string(seed)), "ok");
    std::vector<uint8_t> remote_image(kRemoteSize);
    gputest::fill(remote_image.data(), kRemoteSize, c.remote_gpu ? seed : seed + 1);
    std::vector<uint8_t> local_image(local_span);
    gputest::fill(local_image.data(), local_span, seed * 7 + 3);
    put_local(c, local_image);
    const char* which = c.remote_gpu ? "gpu" : "host";
    if (c.write) {
      Status s = engine_->write(peer_, l, r);
      ASSERT_TRUE(s.ok()) << s.to_string();
      std::vector<uint8_t> expect(remote_span);
      for (size_t i = 0; i < c.batch; ++i) {
        std::copy_n(local_image.begin() + static_cast<long>(i * stride), c.block,
                    expect.begin() + static_cast<long>(i * c.block));
      }
      EXPECT_EQ(target_.ask("sum " + std::string(which) + " 0 " + std::to_string(remote_span)),
                "sum " + std::to_string(gputest::fnv(expect.data(), remote_span)))
          << "remote bytes differ from what was written";
      EXPECT_EQ(
          target_.ask("sum " + std::string(which) + " " + std::to_string(remote_span) + " 64"),
          "sum " + std::to_string(gputest::fnv(remote_image.data() + remote_span, 64)))
          << "bytes past the written range changed";
    } else {
      Status s = engine_->read(peer_, l, r);
      ASSERT_TRUE(s.ok()) << s.to_string();
      const auto got = get_local(c, local_span);
      for (size_t i = 0; i < c.batch; ++i) {
        const uint8_t* want = remote_image.data() + i * c.block;
        const uint8_t* have = got.data() + i * stride;
        ASSERT_EQ(0, std::memcmp(want, have, c.block)) << "block " << i << " differs";
        if (i + 1 < c.batch) {
          ASSERT_EQ(0, std::memcmp(local_image.data() + i * stride + c.block, have + c.block, 5))
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
  std::vector<uint8_t> local_host_;
};

TEST_F(TcpGpuMemory, EveryDirectionSizeAndBatch) {
  // Small blocks in large batches go through the staging copy kernel (below
  // kernel_max_block), large ones through the copy engine; 4 KiB x 4096 is
  // the case that once failed with "pinned host memory not mapped".
  const std::vector<std::pair<uint64_t, size_t>> shapes = {{1, 1},
                                                           {4097, 7},
                                                           {4096, 1024},
                                                           {4096, 4096},
                                                           {513, 300},
                                                           {(64u << 10) + 1, 40},
                                                           {(1u << 20) + 3, 3},
                                                           {8u << 20, 2}};
  uint64_t seed = 11;
  for (bool write : {true, false}) {
    for (int kinds = 1; kinds < 4; ++kinds) {  // host->gpu, gpu->host, gpu->gpu
      for (auto [block, batch] : shapes) {
        run({(kinds & 1) != 0, (kinds & 2) != 0, write, block, batch}, ++seed);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(TcpGpuMemory, AsyncWritesInFlightTogether) {
  // Several async GPU->GPU writes at once share the staging pool and streams.
  ASSERT_EQ(target_.ask("fill 5"), "ok");
  std::vector<uint8_t> image(16u << 20);
  gputest::fill(image.data(), image.size(), 99);
  ASSERT_EQ(cudaMemcpy(local_gpu_, image.data(), image.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  std::vector<TransferId> ids;
  std::vector<LocalIov> l(4);
  std::vector<RemoteIov> r(4);
  for (size_t i = 0; i < 4; ++i) {
    l[i] = {static_cast<uint8_t*>(local_gpu_) + i * (4u << 20), 4u << 20};
    r[i] = {&remote_gpu_, i * (4u << 20), 4u << 20};
    auto id = engine_->write_async(peer_, std::span(&l[i], 1), std::span(&r[i], 1));
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  for (auto id : ids) {
    Status s = engine_->wait(id, std::chrono::seconds(30));
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  EXPECT_EQ(target_.ask("sum gpu 0 " + std::to_string(image.size())),
            "sum " + std::to_string(gputest::fnv(image.data(), image.size())));
}

TEST_F(TcpGpuMemory, SmallTransfersPostedBackToBack) {
  // Many small transfers posted back to back, as a serving loop does: a
  // posting thread copying close behind its previous copy hands it to the
  // GPU path's watcher instead of waiting (gpu_staging.h), and 48 KiB ones
  // are striped into frames whose copies are submitted together. Every
  // direction, writes and reads, each transfer's own bytes checked.
  constexpr size_t kCount = 96;
  uint64_t seed = 500;
  for (uint64_t block : {uint64_t{4096}, uint64_t{48u << 10}}) {
    for (int kinds = 1; kinds < 4; ++kinds) {  // host->gpu, gpu->host, gpu->gpu
      const bool local_gpu = (kinds & 2) != 0, remote_gpu = (kinds & 1) != 0;
      for (bool write : {true, false}) {
        SCOPED_TRACE(name({local_gpu, remote_gpu, write, block, kCount}));
        ++seed;
        const uint64_t span = block * kCount;
        ASSERT_EQ(target_.ask("fill " + std::to_string(seed)), "ok");
        std::vector<uint8_t> remote_image(kRemoteSize);
        gputest::fill(remote_image.data(), kRemoteSize, remote_gpu ? seed : seed + 1);
        std::vector<uint8_t> local_image(span);
        gputest::fill(local_image.data(), span, seed * 13 + 1);
        const Case c{local_gpu, remote_gpu, write, block, kCount};
        put_local(c, local_image);
        uint8_t* base = local_gpu ? static_cast<uint8_t*>(local_gpu_) : local_host_.data();
        const RemoteDescriptor& remote = remote_gpu ? remote_gpu_ : remote_host_;
        // Transfer i: local block i <-> remote block kCount-1-i.
        std::vector<LocalIov> l(kCount);
        std::vector<RemoteIov> r(kCount);
        std::vector<TransferId> ids;
        for (size_t i = 0; i < kCount; ++i) {
          l[i] = {base + i * block, block};
          r[i] = {&remote, (kCount - 1 - i) * block, block};
          auto id = write ? engine_->write_async(peer_, std::span(&l[i], 1), std::span(&r[i], 1))
                          : engine_->read_async(peer_, std::span(&l[i], 1), std::span(&r[i], 1));
          ASSERT_TRUE(id.ok()) << id.status().to_string();
          ids.push_back(*id);
        }
        for (auto id : ids) {
          Status st = engine_->wait(id, std::chrono::seconds(30));
          ASSERT_TRUE(st.ok()) << st.to_string();
        }
        std::vector<uint8_t> expect(span);
        for (size_t i = 0; i < kCount; ++i) {
          const uint8_t* from = write ? local_image.data() + i * block
                                      : remote_image.data() + (kCount - 1 - i) * block;
          std::copy_n(
              from, block,
              expect.begin() + static_cast<long>(write ? (kCount - 1 - i) * block : i * block));
        }
        if (write) {
          EXPECT_EQ(target_.ask(std::string("sum ") + (remote_gpu ? "gpu" : "host") + " 0 " +
                                std::to_string(span)),
                    "sum " + std::to_string(gputest::fnv(expect.data(), span)))
              << "remote bytes differ from what was written";
        } else {
          const auto got = get_local(c, span);
          for (size_t i = 0; i < kCount; ++i) {
            ASSERT_EQ(0, std::memcmp(expect.data() + i * block, got.data() + i * block, block))
                << "transfer " << i << " read wrong bytes";
          }
        }
      }
    }
  }
}

// A write's GPU source is staged only after work queued on the legacy
// default stream (where PyTorch fills tensors) before the call: the buffer is
// set to 0x5A there, behind long memsets, just before each write. One 4 KiB
// block (the inline copy engine), 16 scattered ones (the inline kernel) and
// 3 MiB (the queued path).
TEST_F(TcpGpuMemory, WriteSourceIsReadAfterWorkQueuedOnTheDefaultStream) {
  void* busy = nullptr;
  ASSERT_EQ(cudaMalloc(&busy, 256u << 20), cudaSuccess);
  const std::vector<std::pair<uint64_t, size_t>> shapes = {{4096, 1}, {4096, 16}, {1u << 20, 3}};
  uint8_t fill = 0x5A;
  for (auto [block, batch] : shapes) {
    SCOPED_TRACE(std::to_string(block) + " B x " + std::to_string(batch));
    const uint64_t stride = 2 * block;
    std::vector<LocalIov> l(batch);
    std::vector<RemoteIov> r(batch);
    for (size_t i = 0; i < batch; ++i) {
      l[i] = {static_cast<uint8_t*>(local_gpu_) + i * stride, block};
      r[i] = {&remote_gpu_, i * block, block};
    }
    ASSERT_EQ(cudaMemset(local_gpu_, 0x11, stride * batch), cudaSuccess);
    testing::keep_default_stream_busy(busy, 256u << 20);
    if (HasFatalFailure()) return;
    ASSERT_EQ(cudaMemsetAsync(local_gpu_, ++fill, stride * batch, 0), cudaSuccess);
    Status s = engine_->write(peer_, l, r);
    ASSERT_TRUE(s.ok()) << s.to_string();
    std::vector<uint8_t> expect(block * batch, fill);
    EXPECT_EQ(target_.ask("sum gpu 0 " + std::to_string(expect.size())),
              "sum " + std::to_string(gputest::fnv(expect.data(), expect.size())))
        << "the write sent the buffer before the default stream had filled it";
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(busy);
}

// The same for a read into GPU memory: the destination is zeroed on the
// default stream, behind 16 GiB of memsets, just before each read. The
// read's landing copy is submitted when the data arrives, on a stream of its
// own; it must still run after the zeroing, or the zeroing wipes the bytes
// read. Before the copy waited for a mark of the default stream taken when
// the read was posted (cuda/default_stream_mark.h), the read came back as
// zeros -- what made gpu.two_gpus.TcpGpuCancel fail under `ctest -j4`, where
// other processes on the GPU delay the caller's cudaMemset.
TEST_F(TcpGpuMemory, ReadLandsAfterWorkQueuedOnTheDefaultStream) {
  void* busy = nullptr;
  ASSERT_EQ(cudaMalloc(&busy, 256u << 20), cudaSuccess);
  ASSERT_EQ(target_.ask("fill 77"), "ok");
  const std::vector<std::pair<uint64_t, size_t>> shapes = {{4096, 1}, {4096, 16}, {1u << 20, 3}};
  for (auto [block, batch] : shapes) {
    SCOPED_TRACE(std::to_string(block) + " B x " + std::to_string(batch));
    std::vector<uint8_t> remote(block * batch);
    gputest::fill(remote.data(), remote.size(), 77);  // the target's first bytes
    const uint64_t stride = 2 * block;
    std::vector<LocalIov> l(batch);
    std::vector<RemoteIov> r(batch);
    for (size_t i = 0; i < batch; ++i) {
      l[i] = {static_cast<uint8_t*>(local_gpu_) + i * stride, block};
      r[i] = {&remote_gpu_, i * block, block};
    }
    ASSERT_EQ(cudaMemset(local_gpu_, 0x11, stride * batch), cudaSuccess);
    testing::keep_default_stream_busy(busy, 256u << 20, 64);
    if (HasFatalFailure()) return;
    ASSERT_EQ(cudaMemsetAsync(local_gpu_, 0, stride * batch, 0), cudaSuccess);
    Status s = engine_->read(peer_, l, r);
    ASSERT_TRUE(s.ok()) << s.to_string();
    std::vector<uint8_t> got(block);
    for (size_t i = 0; i < batch; ++i) {
      ASSERT_EQ(cudaMemcpy(got.data(), l[i].address, block, cudaMemcpyDeviceToHost), cudaSuccess);
      const bool zeros = std::all_of(got.begin(), got.end(), [](uint8_t b) { return b == 0; });
      ASSERT_EQ(0, std::memcmp(got.data(), remote.data() + i * block, block))
          << "block " << i << " of the read differs from the target's bytes"
          << (zeros ? ": all zeros, the zeroing queued before the read ran after its landing copy"
                    : "");
    }
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(busy);
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

// Both processes with 2 MiB of staging (two 1 MiB slots): a transfer of many
// times that must flow through the pool, not wait for it to hold everything.
// Before the I/O threads stopped blocking on slots, a GPU->GPU READ of more
// frames than slots stalled the target's I/O thread (30 s, then Busy).
class TcpGpuSmallStaging : public TcpGpuMemory {
 protected:
  void SetUp() override {
    // Inherited by the target process. Small socket buffers: a response's
    // send does not finish in one sendmsg, the I/O thread must go on with it.
    setenv("FERRY_TCP_GPU_STAGING_BYTES", "2MiB", 1);
    setenv("FERRY_TCP_SNDBUF", "64KiB", 1);
    setenv("FERRY_TCP_RCVBUF", "64KiB", 1);
    TcpGpuMemory::SetUp();
  }
  void TearDown() override {
    TcpGpuMemory::TearDown();
    unsetenv("FERRY_TCP_GPU_STAGING_BYTES");
    unsetenv("FERRY_TCP_SNDBUF");
    unsetenv("FERRY_TCP_RCVBUF");
  }
};

TEST_F(TcpGpuSmallStaging, TransfersManyTimesTheStagingPool) {
  uint64_t seed = 500;
  for (bool write : {false, true}) {
    for (int kinds = 1; kinds < 4; ++kinds) {  // host->gpu, gpu->host, gpu->gpu
      const auto start = std::chrono::steady_clock::now();
      run({(kinds & 1) != 0, (kinds & 2) != 0, write, 1u << 20, 40}, ++seed);
      if (HasFatalFailure()) return;
      run({(kinds & 1) != 0, (kinds & 2) != 0, write, 4096, 4096}, ++seed);
      if (HasFatalFailure()) return;
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_LT(s, 10.0) << "56 MiB through two staging slots took " << s << " s";
    }
  }
}

TEST_F(TcpGpuSmallStaging, ReadsInFlightTogetherShareTwoSlots) {
  // Four async GPU->GPU reads of 8 MiB each at once: 32 frames for 2 slots.
  ASSERT_EQ(target_.ask("fill 21"), "ok");
  std::vector<uint8_t> image(kRemoteSize);
  gputest::fill(image.data(), image.size(), 21);
  ASSERT_EQ(cudaMemset(local_gpu_, 0xAB, 32u << 20), cudaSuccess);
  std::vector<LocalIov> l(4);
  std::vector<RemoteIov> r(4);
  std::vector<TransferId> ids;
  for (size_t i = 0; i < 4; ++i) {
    l[i] = {static_cast<uint8_t*>(local_gpu_) + i * (8u << 20), 8u << 20};
    r[i] = {&remote_gpu_, (3 - i) * (8u << 20), 8u << 20};
    auto id = engine_->read_async(peer_, std::span(&l[i], 1), std::span(&r[i], 1));
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  for (auto id : ids) {
    Status s = engine_->wait(id, std::chrono::seconds(20));
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  std::vector<uint8_t> got(32u << 20);
  ASSERT_EQ(cudaMemcpy(got.data(), local_gpu_, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < 4; ++i) {
    ASSERT_EQ(
        0, std::memcmp(got.data() + i * (8u << 20), image.data() + (3 - i) * (8u << 20), 8u << 20))
        << "read " << i << " differs";
  }
}

// A GPU write posted after cancel() of a GPU write returned is never
// overwritten by bytes of the cancelled write still on their way (frames on
// another stream, a target copy in progress). Both processes run 4 I/O
// threads, so the target places frames of different streams in parallel (as
// transfer_test's CancelledWriteNeverOverwritesALaterWrite does for host
// memory). The two writes after each cancel() are GPU writes posted back to
// back: the first is held by tcp's cancel fence while the cancelled write's
// frames are unanswered (and replayed through the staging path), the second
// queues behind it.
class TcpGpuCancel : public TcpGpuMemory {
 protected:
  void SetUp() override {
    setenv("FERRY_TCP_IO_THREADS", "4", 1);  // inherited by the target process
    TcpGpuMemory::SetUp();
  }
  void TearDown() override {
    TcpGpuMemory::TearDown();
    unsetenv("FERRY_TCP_IO_THREADS");
  }
};

TEST_F(TcpGpuCancel, CancelledGpuWriteNeverOverwritesALaterWrite) {
  constexpr uint64_t kRange = 4u << 20;
  constexpr uint64_t kSmall = 64u << 10;
  constexpr uint64_t kHalf = kSmall / 2;
  constexpr uint64_t kSmallAt = kRange - kSmall;  // where a running copy of the range ends
  constexpr int kIovs = 64;                       // 256 MiB per large write
  ASSERT_EQ(target_.ask("fill 31"), "ok");
  std::vector<uint8_t> big(kRange);
  gputest::fill(big.data(), kRange, 96);
  ASSERT_EQ(cudaMemcpy(local_gpu_, big.data(), kRange, cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<LocalIov> l(kIovs, LocalIov{local_gpu_, kRange});
  std::vector<RemoteIov> r(kIovs, RemoteIov{&remote_gpu_, 0, kRange});
  uint8_t* small_src = static_cast<uint8_t*>(local_gpu_) + kRange;
  uint8_t* small_back = small_src + kSmall;
  const LocalIov sl[2] = {{small_src, kHalf}, {small_src + kHalf, kHalf}};
  const RemoteIov sr[2] = {{&remote_gpu_, kSmallAt, kHalf},
                           {&remote_gpu_, kSmallAt + kHalf, kHalf}};
  std::vector<uint8_t> image(kSmall), back(kSmall);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  int rounds = 0, cancelled = 0;
  for (uint64_t seed = 4000; rounds < 100 && std::chrono::steady_clock::now() < end; ++seed) {
    SCOPED_TRACE("round " + std::to_string(rounds));
    ++rounds;
    auto id = engine_->write_async(peer_, l, r);
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    std::this_thread::sleep_for(std::chrono::microseconds(250 * (rounds % 8)));
    ASSERT_TRUE(engine_->cancel(*id).ok());
    const Status c = engine_->wait(*id, std::chrono::seconds(30));
    ASSERT_TRUE(c.code() == StatusCode::kCancelled || c.ok()) << c.to_string();
    if (c.code() == StatusCode::kCancelled) ++cancelled;
    gputest::fill(image.data(), kSmall, seed);
    ASSERT_EQ(cudaMemcpy(small_src, image.data(), kSmall, cudaMemcpyHostToDevice), cudaSuccess);
    TransferId after[2];
    for (int k = 0; k < 2; ++k) {
      auto w = engine_->write_async(peer_, std::span(&sl[k], 1), std::span(&sr[k], 1));
      ASSERT_TRUE(w.ok()) << w.status().to_string();
      after[k] = *w;
    }
    for (TransferId w : after) {
      const Status s = engine_->wait(w, std::chrono::seconds(30));
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    // Late frames of the cancelled write would land within a millisecond or
    // two; give them time to (they must not) before looking.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const std::string sum =
        target_.ask("sum gpu " + std::to_string(kSmallAt) + " " + std::to_string(kSmall));
    ASSERT_EQ(sum, "sum " + std::to_string(gputest::fnv(image.data(), kSmall)))
        << "the target's GPU bytes of writes posted after cancel() returned were overwritten"
        << (sum == "sum " + std::to_string(gputest::fnv(big.data() + kSmallAt, kSmall))
                ? " by the cancelled write's bytes"
                : " in part");
    ASSERT_EQ(cudaMemset(small_back, 0, kSmall), cudaSuccess);
    const LocalIov bl{small_back, kSmall};
    const RemoteIov br{&remote_gpu_, kSmallAt, kSmall};
    const Status s = engine_->read(peer_, std::span(&bl, 1), std::span(&br, 1));
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(cudaMemcpy(back.data(), small_back, kSmall, cudaMemcpyDeviceToHost), cudaSuccess);
    // Zeros: the cudaMemset above ran after the read's landing copy (see
    // ReadLandsAfterWorkQueuedOnTheDefaultStream), not a late frame.
    const bool zeros = std::all_of(back.begin(), back.end(), [](uint8_t b) { return b == 0; });
    ASSERT_EQ(0, std::memcmp(back.data(), image.data(), kSmall))
        << "read back differs from the writes posted after cancel()"
        << (zeros ? " (all zeros: the destination's zeroing ran after the read landed)" : "");
  }
  EXPECT_GT(cancelled, 0) << "no round caught the large write before it finished";
  std::printf("%d rounds, %d cancelled before they finished\n", rounds, cancelled);
}

// A malformed measurement knob of the GPU path is refused by name when the
// path is first needed (the first transfer touching local GPU memory), and
// host memory keeps moving.
class TcpGpuMalformedKnob : public TcpGpuMemory {
 protected:
  void SetUp() override {
    setenv("FERRY_TCP_GPU_HANDOFF_US", "soon", 1);
    TcpGpuMemory::SetUp();
  }
  void TearDown() override {
    TcpGpuMemory::TearDown();
    unsetenv("FERRY_TCP_GPU_HANDOFF_US");
  }
};

TEST_F(TcpGpuMalformedKnob, HandoffWindowRefusedByName) {
  LocalIov l{local_gpu_, 4096};
  RemoteIov r{&remote_host_, 0, 4096};
  Status s = engine_->write(peer_, std::span(&l, 1), std::span(&r, 1));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("FERRY_TCP_GPU_HANDOFF_US=soon"), std::string::npos) << s.to_string();
  run({false, false, true, 4096, 4}, 77);  // host -> host
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

// The stage trace (docs/trace.md) with GPU memory on either side: every
// transfer logged, its staging stages present exactly where GPU memory is
// (stage copies for writes from GPU, target copies for GPU on the target,
// landing copies for reads into GPU), every stage in non-decreasing order --
// the target's stages come from the other process, on the same clock.
class TcpGpuTraced : public TcpGpuMemory {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kTcpForced);  // host->host over tcp too, as the reference
    setenv("FERRY_TCP_TRACE", "true", 1);
    TcpGpuMemory::SetUp();
  }
  void TearDown() override {
    TcpGpuMemory::TearDown();
    unsetenv("FERRY_TCP_TRACE");
  }
};

TEST_F(TcpGpuTraced, StagesOfEveryDirectionPresentAndInOrder) {
  (void)take_engine_traces(engine_->id());
  std::vector<Case> cases;
  for (bool write : {true, false}) {
    for (int kinds = 0; kinds < 4; ++kinds) {
      for (auto [block, batch] : std::vector<std::pair<uint64_t, size_t>>{
               {4096, 1}, {65536, 1}, {262144, 1}, {4096, 64}, {(1u << 20) + 3, 3}}) {
        cases.push_back({(kinds & 1) != 0, (kinds & 2) != 0, write, block, batch});
      }
    }
  }
  uint64_t seed = 900;
  for (const Case& c : cases) {
    run(c, ++seed);
    if (HasFatalFailure()) return;
  }
  const auto records = take_engine_traces(engine_->id());
  ASSERT_EQ(records.size(), cases.size()) << "one record per blocking transfer";
  for (size_t i = 0; i < cases.size(); ++i) {  // blocking: logged in call order
    const Case& c = cases[i];
    const TraceRecord& r = records[i];
    SCOPED_TRACE(name(c) + ": " + tracetest::describe(r));
    EXPECT_EQ(r.op, static_cast<uint8_t>(c.write ? TransferOp::kWrite : TransferOp::kRead));
    EXPECT_EQ(r.local_gpu, c.local_gpu);
    EXPECT_EQ(r.remote_gpu, c.remote_gpu);
    EXPECT_EQ(r.bytes, c.block * c.batch);
    for (const auto& problem : tracetest::check_tcp_record(r)) ADD_FAILURE() << problem;
  }
}

}  // namespace
}  // namespace ferry
