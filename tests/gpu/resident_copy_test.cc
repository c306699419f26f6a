// The resident copy kernel behind CopyStream (CopyOptions::resident_max_block):
// small lone copies of device memory, every byte checked; order after the
// legacy default stream (a gate that opens in time, and one that does not,
// whose copy is deferred to the copy engine); the kernel leaving after its
// linger and coming back; stream order kept when resident copies and ordinary
// batches alternate; a full ring; a stream destroyed with copies in flight.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "ferry/gpu.h"
#include "gpu_test_util.h"

namespace ferry {
namespace {

using ferry::testing::Buffer;
using ferry::testing::GpuTest;
using ferry::testing::keep_default_stream_busy;
using ferry::testing::Mem;
using std::chrono::milliseconds;

constexpr milliseconds kWait{60000};

CopyOptions resident_options(bool after_default_stream = true) {
  CopyOptions o;
  o.resident_max_block = 64 << 10;
  o.resident_linger_us = 200;
  o.after_default_stream = after_default_stream;
  return o;
}

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(rng());
  return v;
}

std::vector<uint8_t> read_back(const uint8_t* dev, size_t n) {
  std::vector<uint8_t> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), dev, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

// Random sizes (1 B to 64 KiB), mostly 16-byte aligned offsets (the resident
// path) and some not (the ordinary one), each waited for; then every byte of
// the destination against a shadow copy kept on the host.
void small_copies_every_byte(int src_device, int dst_device, bool after_default_stream) {
  constexpr size_t kArea = 8 << 20;
  ASSERT_EQ(cudaSetDevice(dst_device), cudaSuccess);
  Buffer dst(Mem::kDevice, kArea);
  ASSERT_EQ(cudaSetDevice(src_device), cudaSuccess);
  Buffer src(Mem::kDevice, kArea);
  const std::vector<uint8_t> data = random_bytes(kArea, 7);
  std::vector<uint8_t> shadow = random_bytes(kArea, 8);
  ASSERT_EQ(cudaMemcpy(src.data(), data.data(), kArea, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dst.data(), shadow.data(), kArea, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto cs = CopyStream::create(src_device, resident_options(after_default_stream));
  ASSERT_TRUE(cs.ok()) << cs.status().to_string();
  std::mt19937_64 rng(src_device * 10 + dst_device);
  for (int i = 0; i < 3000; ++i) {
    const uint64_t size = 1 + rng() % (64 << 10);
    uint64_t so = rng() % (kArea - size), dof = rng() % (kArea - size);
    if (rng() % 8 != 0) {
      so &= ~uint64_t{15};
      dof &= ~uint64_t{15};
    }
    CopyBlock b{dst.data() + dof, src.data() + so, size};
    Result<uint64_t> t = (*cs)->submit({&b, 1}, BlockCheck::kDeviceMemory);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE((*cs)->wait(*t, kWait).ok()) << "copy " << i;
    std::memcpy(shadow.data() + dof, data.data() + so, size);
  }
  const CopyStreamStats st = (*cs)->stats();
  EXPECT_GT(st.resident_blocks, 1000u) << "the resident kernel took too few copies";
  ASSERT_EQ(cudaSetDevice(dst_device), cudaSuccess);
  EXPECT_TRUE(read_back(dst.data(), kArea) == shadow) << "destination differs";
}

TEST_F(GpuTest, ResidentSmallCopiesEveryByte) {
  small_copies_every_byte(0, 0, true);
}

TEST_F(GpuTest, ResidentSmallCopiesUnordered) {
  small_copies_every_byte(0, 0, false);
}

TEST_F(GpuTest, ResidentSmallCopiesToPeerGpu) {
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  if (n < 2) GTEST_SKIP() << "skipped: needs 2 GPUs, " << n << " visible";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaError_t e = cudaDeviceEnablePeerAccess(1, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
  small_copies_every_byte(0, 1, true);
}

// The source is set on the legacy default stream behind work that takes a
// while; the copy must carry the new value. Short work lets the gate open in
// time; long work (far beyond the 50 us gate wait) defers the copy.
TEST_F(GpuTest, ResidentCopyRunsAfterTheDefaultStream) {
  constexpr size_t kCopy = 4096, kScratch = 256 << 20;
  Buffer src(Mem::kDevice, kCopy), dst(Mem::kDevice, kCopy), scratch(Mem::kDevice, kScratch);
  auto cs = CopyStream::create(0, resident_options());
  ASSERT_TRUE(cs.ok()) << cs.status().to_string();
  for (int round = 0; round < 40; ++round) {
    const bool long_work = round % 2 == 0;
    if (long_work) keep_default_stream_busy(scratch.data(), kScratch, 8);
    const int value = 1 + round;
    ASSERT_EQ(cudaMemsetAsync(src.data(), value, kCopy, 0), cudaSuccess);
    CopyBlock b{dst.data(), src.data(), kCopy};
    Result<uint64_t> t = (*cs)->submit({&b, 1}, BlockCheck::kDeviceMemory);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE((*cs)->wait(*t, kWait).ok());
    const std::vector<uint8_t> got = read_back(dst.data(), kCopy);
    for (size_t i = 0; i < kCopy; ++i) {
      ASSERT_EQ(got[i], value) << "round " << round << ": byte " << i
                               << " copied before the default stream set it";
    }
  }
  const CopyStreamStats st = (*cs)->stats();
  EXPECT_GT(st.resident_deferred, 0u) << "long work on the default stream deferred no copy";
  EXPECT_LT(st.resident_deferred, st.resident_blocks) << "every copy was deferred";
}

// Copies further apart than the linger: the kernel leaves and is launched
// again; a device synchronisation does not wait long for it.
TEST_F(GpuTest, ResidentKernelLeavesAndComesBack) {
  constexpr size_t kCopy = 8192;
  Buffer src(Mem::kDevice, kCopy), dst(Mem::kDevice, kCopy);
  auto cs = CopyStream::create(0, resident_options());
  ASSERT_TRUE(cs.ok()) << cs.status().to_string();
  for (int round = 0; round < 20; ++round) {
    const std::vector<uint8_t> data = random_bytes(kCopy, 100 + round);
    ASSERT_EQ(cudaMemcpy(src.data(), data.data(), kCopy, cudaMemcpyHostToDevice), cudaSuccess);
    CopyBlock b{dst.data(), src.data(), kCopy};
    Result<uint64_t> t = (*cs)->submit({&b, 1}, BlockCheck::kDeviceMemory);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE((*cs)->wait(*t, kWait).ok());
    ASSERT_TRUE(read_back(dst.data(), kCopy) == data) << "round " << round;
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(100))
        << "cudaDeviceSynchronize waited long for the resident kernel";
    std::this_thread::sleep_for(std::chrono::microseconds(round % 2 == 0 ? 50 : 2000));
  }
  EXPECT_GE((*cs)->stats().resident_blocks, 20u);
}

// Lone small copies and multi-block batches alternate, each reading what the
// one before wrote, without waiting in between: stream order must hold.
TEST_F(GpuTest, ResidentCopiesAndBatchesKeepStreamOrder) {
  constexpr size_t kRegion = 16 << 10;
  constexpr int kSteps = 400;
  Buffer dev(Mem::kDevice, kRegion * (kSteps + 1));
  const std::vector<uint8_t> data = random_bytes(kRegion, 3);
  ASSERT_EQ(cudaMemcpy(dev.data(), data.data(), kRegion, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto cs = CopyStream::create(0, resident_options());
  ASSERT_TRUE(cs.ok()) << cs.status().to_string();
  std::mt19937_64 rng(5);
  uint64_t last = 0;
  for (int k = 1; k <= kSteps; ++k) {
    uint8_t* to = dev.data() + k * kRegion;
    const uint8_t* from = dev.data() + (k - 1) * kRegion;
    std::vector<CopyBlock> blocks;
    if (rng() % 3 != 0) {
      blocks.push_back({to, from, kRegion});  // one block: resident
    } else {
      for (size_t i = 0; i < kRegion / 4096; ++i)
        blocks.push_back({to + i * 4096, from + i * 4096, 4096});
    }
    Result<uint64_t> t = (*cs)->submit(blocks, BlockCheck::kDeviceMemory);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_EQ(*t, last + 1) << "tickets count 1, 2, 3, ...";
    last = *t;
  }
  ASSERT_TRUE((*cs)->wait(last, kWait).ok());
  EXPECT_EQ((*cs)->completed_through(), last);
  EXPECT_TRUE(read_back(dev.data() + kSteps * kRegion, kRegion) == data)
      << "a copy ran before the one it reads from";
  EXPECT_GT((*cs)->stats().resident_blocks, 0u);
}

// More small copies in flight than the ring has slots, then a stream destroyed
// with copies in flight.
TEST_F(GpuTest, ResidentRingFullAndDestroyedInFlight) {
  constexpr size_t kCopy = 4096;
  constexpr int kCopies = 500;
  Buffer src(Mem::kDevice, kCopy * kCopies), dst(Mem::kDevice, kCopy * kCopies);
  const std::vector<uint8_t> data = random_bytes(kCopy * kCopies, 11);
  ASSERT_EQ(cudaMemcpy(src.data(), data.data(), data.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dst.data(), 0, data.size()), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  {
    auto cs = CopyStream::create(0, resident_options());
    ASSERT_TRUE(cs.ok()) << cs.status().to_string();
    uint64_t last = 0;
    for (int i = 0; i < kCopies; ++i) {
      CopyBlock b{dst.data() + i * kCopy, src.data() + i * kCopy, kCopy};
      Result<uint64_t> t = (*cs)->submit({&b, 1}, BlockCheck::kDeviceMemory);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      last = *t;
    }
    ASSERT_TRUE((*cs)->wait(last, kWait).ok());
    EXPECT_TRUE(read_back(dst.data(), data.size()) == data);
  }
  for (int round = 0; round < 5; ++round) {
    auto cs = CopyStream::create(0, resident_options());
    ASSERT_TRUE(cs.ok()) << cs.status().to_string();
    for (int i = 0; i < 50; ++i) {
      CopyBlock b{dst.data() + i * kCopy, src.data() + i * kCopy, kCopy};
      ASSERT_TRUE((*cs)->submit({&b, 1}, BlockCheck::kDeviceMemory).ok());
    }
    // Destroyed here with copies in flight: its kernel is told to leave.
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace ferry
