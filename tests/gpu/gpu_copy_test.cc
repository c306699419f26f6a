// Batched copy on a real GPU: every direction x block size x misaligned
// offsets x path (kernel, copy engine batch, copy engine loop, automatic),
// random data, poisoned destinations, every byte of the destination buffer
// checked (so bytes next to each block must be untouched). Plus ordering,
// SM budget, and rejection of invalid input.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_detect.h"
#include "ferry/gpu.h"
#include "gpu_test_util.h"

namespace ferry {
namespace {

using ferry::testing::Buffer;
using ferry::testing::GpuTest;
using ferry::testing::Mem;
using ferry::testing::mem_name;
using std::chrono::milliseconds;

constexpr uint64_t kSizes[] = {1, 3, 4096, 4100, 16 << 10, 64 << 10, (1 << 20) + 5};
constexpr milliseconds kWait{60000};

uint8_t poison(size_t i) {
  return static_cast<uint8_t>(0x5A ^ (i * 131));
}

struct Mode {
  const char* name;
  CopyOptions opts;
};

std::vector<Mode> modes() {
  CopyOptions automatic;  // defaults
  CopyOptions kernel;
  kernel.sm_budget = 8;
  kernel.kernel_max_block = UINT64_MAX;
  CopyOptions one_cta = kernel;
  one_cta.sm_budget = 1;
  CopyOptions batch;
  batch.sm_budget = 0;
  CopyOptions loop = batch;
  loop.use_batch_api = false;
  return {{"auto", automatic},
          {"kernel8", kernel},
          {"kernel1", one_cta},
          {"engine-batch", batch},
          {"engine-loop", loop}};
}

// Copies `nblocks` blocks of `size` bytes from a `src_kind` buffer into a
// `dst_kind` buffer at random offsets (independent alignments of source and
// destination), in shuffled order, and checks the whole destination buffer.
void check_copy(CopyStream& cs, Mem src_kind, Mem dst_kind, uint64_t size, std::mt19937_64& rng) {
  const size_t nblocks = size >= (1 << 20) ? 4 : size >= (64 << 10) ? 12 : 48;
  const size_t stride = (size + 64 + 63) / 64 * 64;
  const size_t total = nblocks * stride + 64;
  Buffer src(src_kind, total), dst(dst_kind, total);
  ASSERT_TRUE(src.ok() && dst.ok());

  std::vector<uint8_t> src_host(total), expect(total);
  for (auto& b : src_host) b = static_cast<uint8_t>(rng());
  for (size_t i = 0; i < total; ++i) expect[i] = poison(i);
  src.upload(src_host.data());
  dst.upload(expect.data());

  std::vector<CopyBlock> blocks;
  for (size_t b = 0; b < nblocks; ++b) {
    const size_t soff = b * stride + rng() % 32;
    const size_t doff = b * stride + rng() % 32;
    blocks.push_back({dst.data() + doff, src.data() + soff, size});
    std::memcpy(expect.data() + doff, src_host.data() + soff, size);
  }
  std::shuffle(blocks.begin(), blocks.end(), rng);

  Result<uint64_t> t = cs.submit(blocks);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  Status s = cs.wait(t.value(), kWait);
  ASSERT_TRUE(s.ok()) << s.to_string();

  std::vector<uint8_t> got(total);
  dst.download(got.data());
  auto [g, e] = std::mismatch(got.begin(), got.end(), expect.begin());
  if (g != got.end()) {
    const size_t at = static_cast<size_t>(g - got.begin());
    FAIL() << "first wrong byte at dst offset " << at << " (slot " << at / stride << ", byte "
           << at % stride << " of the slot): got " << int(*g) << " expected " << int(*e)
           << (*e == poison(at) ? " (poison: written outside a block?)" : "");
  }
}

struct Direction {
  const char* name;
  Mem src, dst;
};

constexpr Direction kDirections[] = {
    {"H2D", Mem::kPinned, Mem::kDevice},
    {"D2H", Mem::kDevice, Mem::kPinned},
    {"D2D", Mem::kDevice, Mem::kDevice},
    {"H2D-registered", Mem::kRegistered, Mem::kDevice},
    {"D2H-registered", Mem::kDevice, Mem::kRegistered},
    {"H2H-pinned", Mem::kPinned, Mem::kPinned},
    {"managed-to-device", Mem::kManaged, Mem::kDevice},
};

class GpuCopyMatrix : public GpuTest, public ::testing::WithParamInterface<int> {};

TEST_P(GpuCopyMatrix, EveryDirectionSizeAndAlignment) {
  const Mode mode = modes()[GetParam()];
  Result<std::unique_ptr<CopyStream>> cs = CopyStream::create(0, mode.opts);
  ASSERT_TRUE(cs.ok()) << cs.status().to_string();
  std::mt19937_64 rng(0xF3A7 + GetParam());
  for (const Direction& d : kDirections) {
    for (uint64_t size : kSizes) {
      SCOPED_TRACE(std::string(mode.name) + " " + d.name + " " + mem_name(d.src) + "->" +
                   mem_name(d.dst) + " block " + std::to_string(size));
      check_copy(*cs.value(), d.src, d.dst, size, rng);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  CopyStreamStats st = cs.value()->stats();
  if (mode.opts.sm_budget == 0) {
    EXPECT_EQ(st.kernel_blocks, 0u);
  } else {
    EXPECT_GT(st.kernel_blocks, 0u);
    EXPECT_LE(st.max_ctas, mode.opts.sm_budget);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, GpuCopyMatrix, ::testing::Range(0, 5),
                         [](const ::testing::TestParamInfo<int>& i) {
                           std::string n = modes()[i.param].name;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// One batch mixing every size and both directions: kernel and copy engine
// run concurrently on two streams and must both be done at the ticket.
TEST_F(GpuTest, MixedBatchBothPathsBothDirections) {
  Result<std::unique_ptr<CopyStream>> cs = CopyStream::create(0, CopyOptions{});
  ASSERT_TRUE(cs.ok()) << cs.status().to_string();
  const size_t n = 8 << 20;
  Buffer host_a(Mem::kPinned, n), dev_a(Mem::kDevice, n), host_b(Mem::kPinned, n),
      dev_b(Mem::kDevice, n);
  std::mt19937_64 rng(7);
  std::vector<uint8_t> a(n), b(n), exp_dev(n), exp_host(n);
  for (auto& x : a) x = static_cast<uint8_t>(rng());
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  for (size_t i = 0; i < n; ++i) exp_dev[i] = exp_host[i] = poison(i);
  host_a.upload(a.data());
  dev_b.upload(b.data());
  dev_a.upload(exp_dev.data());
  host_b.upload(exp_host.data());
  std::vector<CopyBlock> blocks;
  size_t off = 0;
  for (int rep = 0; rep < 6; ++rep) {
    for (uint64_t size : kSizes) {
      const size_t o = off + rng() % 16;
      if (o + size + 64 > n) break;
      blocks.push_back({dev_a.data() + o, host_a.data() + o, size});  // H2D
      blocks.push_back({host_b.data() + o, dev_b.data() + o, size});  // D2H
      std::memcpy(exp_dev.data() + o, a.data() + o, size);
      std::memcpy(exp_host.data() + o, b.data() + o, size);
      off = o + size + 32;
    }
  }
  std::shuffle(blocks.begin(), blocks.end(), rng);
  Result<uint64_t> t = cs.value()->submit(blocks);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_TRUE(cs.value()->wait(t.value(), kWait).ok());
  std::vector<uint8_t> got(n);
  dev_a.download(got.data());
  EXPECT_TRUE(got == exp_dev) << "H2D half wrong";
  host_b.download(got.data());
  EXPECT_TRUE(got == exp_host) << "D2H half wrong";
  CopyStreamStats st = cs.value()->stats();
  EXPECT_GT(st.kernel_blocks, 0u);
  EXPECT_GT(st.engine_blocks, 0u);
}

// Each submission copies region k-1 into region k: only in-order execution
// yields the original bytes in the last region. Completions must be seen in
// submission order.
TEST_F(GpuTest, CopyStreamRunsAndCompletesInOrder) {
  for (uint32_t budget : {0u, 4u}) {
    CopyOptions o;
    o.sm_budget = budget;
    Result<std::unique_ptr<CopyStream>> r = CopyStream::create(0, o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    CopyStream& cs = *r.value();
    constexpr int kSteps = 300;
    constexpr size_t kRegion = 64 << 10;  // 16 blocks of 4 KiB
    Buffer dev(Mem::kDevice, kRegion * (kSteps + 1)), host(Mem::kPinned, kRegion);
    std::vector<uint8_t> data(kRegion);
    std::mt19937_64 rng(budget);
    for (auto& x : data) x = static_cast<uint8_t>(rng());
    ASSERT_EQ(cudaMemcpy(dev.data(), data.data(), kRegion, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint64_t> tickets;
    uint64_t last_done = 0;
    for (int k = 1; k <= kSteps; ++k) {
      std::vector<CopyBlock> blocks;
      for (size_t i = 0; i < kRegion / 4096; ++i) {
        blocks.push_back(
            {dev.data() + k * kRegion + i * 4096, dev.data() + (k - 1) * kRegion + i * 4096, 4096});
      }
      Result<uint64_t> t = cs.submit(blocks);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      ASSERT_EQ(t.value(), static_cast<uint64_t>(k)) << "tickets count 1, 2, 3, ...";
      tickets.push_back(t.value());
      // Poll a random earlier ticket: if it is done, every one before it is.
      const uint64_t probe = tickets[rng() % tickets.size()];
      Status p = cs.poll(probe);
      ASSERT_TRUE(p.ok() || p.code() == StatusCode::kInProgress) << p.to_string();
      const uint64_t through = cs.completed_through();
      ASSERT_GE(through, last_done) << "completed_through went backwards";
      last_done = through;
      if (p.ok()) {
        ASSERT_GE(through, probe);
      }
      for (uint64_t j = 1; j <= through; ++j) ASSERT_TRUE(cs.poll(j).ok());
    }
    CopyBlock out{host.data(), dev.data() + kSteps * kRegion, kRegion};
    Result<uint64_t> t = cs.submit({&out, 1});
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(cs.wait(t.value(), kWait).ok());
    EXPECT_EQ(cs.completed_through(), t.value());
    EXPECT_EQ(cs.last_submitted(), t.value());
    EXPECT_EQ(std::memcmp(host.data(), data.data(), kRegion), 0) << "budget " << budget;
  }
}

// The CPU rewrites the same pinned buffer between copies (as an offload ring
// does): every copy must carry the new bytes, in both directions, even though
// the GPU's L2 may hold lines of that host memory from the previous copy.
TEST_F(GpuTest, RewrittenHostMemoryIsCopiedFresh) {
  Result<std::unique_ptr<CopyStream>> r = CopyStream::create(0, CopyOptions{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  CopyStream& cs = *r.value();
  constexpr size_t kBlocks = 1024, kBlock = 4096, kBytes = kBlocks * kBlock;
  Buffer host(Mem::kPinned, kBytes), dev(Mem::kDevice, kBytes);
  std::vector<CopyBlock> h2d, d2h;
  for (size_t i = 0; i < kBlocks; ++i) {
    const size_t j = (i * 389) % kBlocks;
    h2d.push_back({dev.data() + j * kBlock, host.data() + i * kBlock, kBlock});
    d2h.push_back({host.data() + i * kBlock, dev.data() + j * kBlock, kBlock});
  }
  std::vector<uint8_t> got(kBytes);
  for (int round = 0; round < 6; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    // H2D: new host bytes each round.
    for (size_t i = 0; i < kBytes; ++i) host.data()[i] = static_cast<uint8_t>(round * 37 + i / 61);
    Result<uint64_t> t = cs.submit(h2d);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE(cs.wait(t.value(), kWait).ok());
    dev.download(got.data());
    for (size_t i = 0; i < kBlocks; ++i) {
      const size_t j = (i * 389) % kBlocks;
      for (size_t k = 0; k < kBlock; k += 511) {
        ASSERT_EQ(got[j * kBlock + k], static_cast<uint8_t>(round * 37 + (i * kBlock + k) / 61))
            << "H2D block " << i << " byte " << k << ": stale host data";
      }
    }
    // D2H: the device side changes, the host is poisoned first.
    FERRY_CUDA_OK(cudaMemset(dev.data(), 0x30 + round, kBytes));
    FERRY_CUDA_OK(cudaDeviceSynchronize());
    std::memset(host.data(), 0xEE, kBytes);
    t = cs.submit(d2h);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE(cs.wait(t.value(), kWait).ok());
    for (size_t i = 0; i < kBytes; i += 509) {
      ASSERT_EQ(host.data()[i], 0x30 + round) << "D2H byte " << i;
    }
  }
}

// The tcp transport submits from its own threads, which have made no CUDA
// call before (no current context). Pinned memory allocated the way its
// staging pool does it (cudaHostAllocMapped | cudaHostAllocPortable) must
// still be classified as mapped there: it used to come back as "pinned host
// memory not mapped for the GPU" for every block below kernel_max_block.
TEST_F(GpuTest, SubmitFromAThreadThatHasNoContext) {
  Result<std::unique_ptr<CopyStream>> r = CopyStream::create(0, CopyOptions{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  CopyStream& cs = *r.value();
  constexpr size_t kBlocks = 512, kBlock = 4096, kBytes = kBlocks * kBlock;
  uint8_t* staging = nullptr;
  FERRY_CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&staging), kBytes,
                              cudaHostAllocMapped | cudaHostAllocPortable));
  Buffer dev(Mem::kDevice, kBytes);
  std::vector<uint8_t> data(kBytes), got(kBytes);
  std::mt19937_64 rng(7);
  for (auto& x : data) x = static_cast<uint8_t>(rng());
  std::vector<size_t> perm(kBlocks);
  for (size_t i = 0; i < kBlocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<CopyBlock> h2d, d2h;
  for (size_t i = 0; i < kBlocks; ++i) {
    h2d.push_back({dev.data() + perm[i] * kBlock, staging + i * kBlock, kBlock});
    d2h.push_back({staging + i * kBlock, dev.data() + perm[i] * kBlock, kBlock});
  }
  std::string raw, info_error, h2d_error, d2h_error;
  uint64_t info_address = 0;
  std::memcpy(staging, data.data(), kBytes);
  FERRY_CUDA_OK(cudaMemset(dev.data(), 0xEE, kBytes));
  FERRY_CUDA_OK(cudaDeviceSynchronize());
  std::thread([&] {
    // What the runtime itself answers on this thread (diagnostic, printed).
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, staging);
    raw = std::string(cudaGetErrorName(e)) + " type " + std::to_string(a.type) + " devicePointer " +
          (a.devicePointer != nullptr ? "set" : "NULL");
    Result<CudaPointerInfo> info = cuda_pointer_info(staging);
    if (!info.ok()) {
      info_error = info.status().to_string();
    } else {
      info_address = info->device_address;
    }
    Result<uint64_t> t = cs.submit(h2d);
    Status s = t.ok() ? cs.wait(t.value(), kWait) : t.status();
    if (!s.ok()) h2d_error = s.to_string();
  }).join();
  std::printf("[ info ] cudaPointerGetAttributes on a fresh thread: %s\n", raw.c_str());
  ASSERT_EQ(info_error, "");
  EXPECT_EQ(info_address, reinterpret_cast<uint64_t>(staging)) << "device address of mapped memory";
  ASSERT_EQ(h2d_error, "") << "H2D submitted from a thread without a context";
  dev.download(got.data());
  for (size_t i = 0; i < kBlocks; ++i) {
    ASSERT_EQ(0, std::memcmp(got.data() + perm[i] * kBlock, data.data() + i * kBlock, kBlock))
        << "H2D block " << i;
  }
  std::memset(staging, 0xEE, kBytes);
  std::thread([&] {
    Result<uint64_t> t = cs.submit(d2h);
    Status s = t.ok() ? cs.wait(t.value(), kWait) : t.status();
    if (!s.ok()) d2h_error = s.to_string();
  }).join();
  ASSERT_EQ(d2h_error, "") << "D2H submitted from a thread without a context";
  EXPECT_EQ(0, std::memcmp(staging, data.data(), kBytes)) << "D2H bytes differ";
  FERRY_CUDA_OK(cudaFreeHost(staging));
}

// Batches larger than the pre-scan limit, whose kernel descriptors outgrow
// the first staging buffer (blocks of several 16 KiB descriptors) and which
// mix both paths: random data, poisoned destination, every byte compared.
TEST_F(GpuTest, LargeBatchesSpanSeveralStagingBuffers) {
  for (uint32_t budget : {16u, 3u}) {
    CopyOptions o;
    o.sm_budget = budget;
    Result<std::unique_ptr<CopyStream>> r = CopyStream::create(0, o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    CopyStream& cs = *r.value();
    // 6000 blocks: mostly 20 KiB + 3 (2 descriptors each), every 97th 600 KiB
    // (copy engine), every 7th 4 KiB - 1; packed with random gaps.
    constexpr size_t kBlocks = 6000;
    std::mt19937_64 rng(1234 + budget);
    std::vector<uint64_t> sizes(kBlocks), offs(kBlocks);
    uint64_t total = 0;
    for (size_t i = 0; i < kBlocks; ++i) {
      sizes[i] = i % 97 == 0 ? 600u << 10 : i % 7 == 0 ? 4095 : (20u << 10) + 3;
      offs[i] = total + rng() % 64;
      total = offs[i] + sizes[i];
    }
    for (bool h2d : {true, false}) {
      SCOPED_TRACE(std::string(h2d ? "H2D" : "D2H") + " budget " + std::to_string(budget));
      Buffer host(Mem::kPinned, total), dev(Mem::kDevice, total);
      ASSERT_TRUE(host.ok() && dev.ok());
      std::vector<uint8_t> data(total), got(total);
      for (size_t i = 0; i < total; i += 8) {
        const uint64_t v = rng();
        std::memcpy(data.data() + i, &v, std::min<size_t>(8, total - i));
      }
      std::vector<size_t> perm(kBlocks);
      for (size_t i = 0; i < kBlocks; ++i) perm[i] = i;
      std::shuffle(perm.begin(), perm.end(), rng);
      // Same offsets on both sides, blocks submitted in shuffled order.
      std::vector<CopyBlock> blocks;
      for (size_t k = 0; k < kBlocks; ++k) {
        const size_t i = perm[k];
        uint8_t* d = (h2d ? dev.data() : host.data()) + offs[i];
        uint8_t* s = (h2d ? host.data() : dev.data()) + offs[i];
        blocks.push_back({d, s, sizes[i]});
      }
      std::vector<uint8_t> poisoned(total);
      for (size_t i = 0; i < total; ++i) poisoned[i] = poison(i);
      if (h2d) {
        host.upload(data.data());
        dev.upload(poisoned.data());
      } else {
        dev.upload(data.data());
        host.upload(poisoned.data());
      }
      FERRY_CUDA_OK(cudaDeviceSynchronize());
      Result<uint64_t> t = cs.submit(blocks);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      ASSERT_TRUE(cs.wait(t.value(), kWait).ok());
      (h2d ? dev : host).download(got.data());
      std::vector<uint8_t> want = poisoned;
      for (size_t i = 0; i < kBlocks; ++i) {
        std::memcpy(want.data() + offs[i], data.data() + offs[i], sizes[i]);
      }
      size_t bad = 0;
      for (size_t i = 0; i < total; ++i) bad += got[i] != want[i];
      ASSERT_EQ(bad, 0u) << "bytes differ (copied or untouched)";
    }
    const CopyStreamStats st = cs.stats();
    EXPECT_GT(st.kernel_launches, 2u);
    EXPECT_GT(st.engine_blocks, 0u);
  }
}

// Successive batches reuse the stream's descriptor staging with different
// descriptors; the kernel must read the new ones (the bench once saw a D2H
// batch execute the previous batch's descriptors).
TEST_F(GpuTest, ReusedDescriptorBuffersAreReadFresh) {
  Result<std::unique_ptr<CopyStream>> r = CopyStream::create(0, CopyOptions{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  CopyStream& cs = *r.value();
  constexpr size_t kBlocks = 4096, kBlock = 4096, kBytes = kBlocks * kBlock;
  Buffer src(Mem::kDevice, kBytes), dst(Mem::kDevice, kBytes);
  std::vector<uint8_t> data(kBytes), got(kBytes);
  std::mt19937_64 rng(99);
  for (auto& x : data) x = static_cast<uint8_t>(rng());
  src.upload(data.data());
  std::vector<size_t> perm(kBlocks);
  for (size_t i = 0; i < kBlocks; ++i) perm[i] = i;
  for (int round = 0; round < 6; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<CopyBlock> blocks;
    for (size_t i = 0; i < kBlocks; ++i) {
      blocks.push_back({dst.data() + perm[i] * kBlock, src.data() + i * kBlock, kBlock});
    }
    FERRY_CUDA_OK(cudaMemset(dst.data(), 0xEE, kBytes));
    FERRY_CUDA_OK(cudaDeviceSynchronize());
    Result<uint64_t> t = cs.submit(blocks);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE(cs.wait(t.value(), kWait).ok());
    dst.download(got.data());
    size_t wrong = 0;
    for (size_t i = 0; i < kBlocks; ++i) {
      wrong += std::memcmp(got.data() + perm[i] * kBlock, data.data() + i * kBlock, kBlock) != 0;
    }
    ASSERT_EQ(wrong, 0u) << "blocks copied per stale descriptors";
  }
}

// A host callback holds the stream, so the ticket is observably in flight.
TEST_F(GpuTest, PollAndWaitWhileInFlight) {
  Result<std::unique_ptr<CopyStream>> r = CopyStream::create(0, CopyOptions{});
  ASSERT_TRUE(r.ok());
  CopyStream& cs = *r.value();
  Buffer a(Mem::kDevice, 4096), b(Mem::kPinned, 4096);
  CopyBlock blk{b.data(), a.data(), 4096};
  // Warm-up: the stream allocates its descriptor staging now, not while held.
  Result<uint64_t> t0 = cs.submit({&blk, 1});
  ASSERT_TRUE(t0.ok());
  ASSERT_TRUE(cs.wait(t0.value(), kWait).ok());
  static std::atomic<bool> release{false};
  release = false;
  // Lets the stream go on whatever happens below (the destructor waits for it).
  struct Release {
    ~Release() { release = true; }
  } release_on_exit;
  FERRY_CUDA_OK(cudaLaunchHostFunc(
      static_cast<cudaStream_t>(cs.native_stream()),
      [](void*) {
        while (!release.load()) {
        }
      },
      nullptr));
  Result<uint64_t> t = cs.submit({&blk, 1});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(cs.poll(t.value()).code(), StatusCode::kInProgress);
  Status w = cs.wait(t.value(), milliseconds(20));
  EXPECT_EQ(w.code(), StatusCode::kTimeout) << w.to_string();
  EXPECT_EQ(cs.completed_through(), t0.value());
  release = true;
  EXPECT_TRUE(cs.wait(t.value(), kWait).ok());
  EXPECT_EQ(cs.poll(t.value() + 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cs.poll(0).code(), StatusCode::kInvalidArgument);
}

TEST_F(GpuTest, SmBudgetIsHonoured) {
  constexpr size_t kBlocks = 8192;
  Buffer src(Mem::kPinned, kBlocks * 4096), dst(Mem::kDevice, kBlocks * 4096);
  std::vector<CopyBlock> blocks;
  for (size_t i = 0; i < kBlocks; ++i) {
    blocks.push_back({dst.data() + i * 4096, src.data() + ((i * 7919) % kBlocks) * 4096, 4096});
  }
  for (uint32_t budget : {1u, 3u, 8u, 0u, 100000u}) {
    CopyOptions o;
    o.sm_budget = budget;
    Result<std::unique_ptr<CopyStream>> r = CopyStream::create(0, o);
    ASSERT_TRUE(r.ok());
    Result<uint64_t> t = r.value()->submit(blocks);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE(r.value()->wait(t.value(), kWait).ok());
    CopyStreamStats st = r.value()->stats();
    int sms = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
    const uint32_t cap = std::min<uint32_t>(budget, static_cast<uint32_t>(sms));
    SCOPED_TRACE("budget " + std::to_string(budget));
    if (budget == 0) {
      EXPECT_EQ(st.kernel_blocks, 0u);
      EXPECT_EQ(st.engine_blocks, kBlocks);
      EXPECT_EQ(st.sms_used, 0u);
    } else {
      EXPECT_EQ(st.kernel_blocks, kBlocks);
      EXPECT_EQ(st.engine_blocks, 0u);
      EXPECT_LE(st.max_ctas, cap);
      EXPECT_GE(st.sms_used, 1u);
      EXPECT_LE(st.sms_used, cap) << "the kernel ran on more SMs than its budget";
    }
  }
}

TEST_F(GpuTest, OneShotCopyBlocks) {
  Buffer src(Mem::kPinned, 1 << 20), dst(Mem::kDevice, 1 << 20);
  std::vector<uint8_t> data(1 << 20), got(1 << 20);
  std::mt19937_64 rng(3);
  for (auto& x : data) x = static_cast<uint8_t>(rng());
  src.upload(data.data());
  std::vector<CopyBlock> blocks;
  for (size_t i = 0; i < 256; ++i) {
    blocks.push_back({dst.data() + i * 4096, src.data() + (255 - i) * 4096, 4096});
  }
  ASSERT_TRUE(copy_blocks(blocks).ok());
  dst.download(got.data());
  for (size_t i = 0; i < 256; ++i) {
    ASSERT_EQ(std::memcmp(got.data() + i * 4096, data.data() + (255 - i) * 4096, 4096), 0) << i;
  }
  CopyOptions engine;
  engine.sm_budget = 0;
  ASSERT_TRUE(copy_blocks(blocks, engine, 0).ok());
  EXPECT_EQ(copy_blocks(blocks, CopyOptions{}, 9999).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(copy_blocks({}).ok());
}

TEST_F(GpuTest, InvalidInputIsRejectedClearly) {
  Result<std::unique_ptr<CopyStream>> r = CopyStream::create(0, CopyOptions{});
  ASSERT_TRUE(r.ok());
  CopyStream& cs = *r.value();
  Buffer dev(Mem::kDevice, 1 << 20), pinned(Mem::kPinned, 1 << 20);
  std::vector<uint8_t> pageable(1 << 20, 0x11);

  // Null pointer, named with its block index.
  std::vector<CopyBlock> b = {{dev.data(), pinned.data(), 64},
                              {dev.data() + 64, pinned.data() + 64, 64},
                              {nullptr, pinned.data(), 64}};
  Result<uint64_t> t = cs.submit(b);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("block 2"), std::string::npos) << t.status().to_string();
  EXPECT_NE(t.status().message().find("null dst"), std::string::npos) << t.status().to_string();

  // Pageable host memory on the kernel path: named, with the pointer and a way out.
  b = {{dev.data(), pinned.data(), 4096}, {dev.data() + 4096, pageable.data(), 4096}};
  t = cs.submit(b);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = t.status().message();
  EXPECT_NE(m.find("block 1"), std::string::npos) << m;
  EXPECT_NE(m.find("pageable"), std::string::npos) << m;
  char addr[32];
  std::snprintf(addr, sizeof addr, "%p", static_cast<void*>(pageable.data()));
  EXPECT_NE(m.find(addr), std::string::npos) << m;
  std::cout << "pageable rejection reads: " << t.status().to_string() << "\n";

  // A block running past the end of its allocation is refused, not faulted on.
  Result<CudaPointerInfo> info = cuda_pointer_info(dev.data());
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  auto* end = reinterpret_cast<uint8_t*>(info->base + info->size);
  b = {{end - 100, pinned.data(), 4096}};
  t = cs.submit(b);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kOutOfRange) << t.status().to_string();

  // The stream still works after rejected batches; nothing was issued for them.
  EXPECT_EQ(cs.last_submitted(), 0u);
  b = {{dev.data(), pinned.data(), 4096}};
  t = cs.submit(b);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t.value(), 1u);
  EXPECT_TRUE(cs.wait(t.value(), kWait).ok());

  // The copy engine accepts pageable memory: sm_budget = 0, or a large block.
  CopyOptions engine;
  engine.sm_budget = 0;
  Result<std::unique_ptr<CopyStream>> ce = CopyStream::create(0, engine);
  ASSERT_TRUE(ce.ok());
  b = {{pageable.data() + 8192, dev.data(), 4096}};
  ASSERT_TRUE(cudaMemset(dev.data(), 0x42, 4096) == cudaSuccess);
  ASSERT_TRUE(cudaDeviceSynchronize() == cudaSuccess);
  t = ce.value()->submit(b);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_TRUE(ce.value()->wait(t.value(), kWait).ok());
  EXPECT_EQ(pageable[8192], 0x42);
  EXPECT_EQ(pageable[8192 + 4095], 0x42);
  EXPECT_EQ(pageable[8192 + 4096], 0x11);
  b = {{pageable.data(), dev.data(), 1 << 20}};  // >= kernel_max_block: copy engine
  t = cs.submit(b);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_TRUE(cs.wait(t.value(), kWait).ok());

  // Zero-size blocks are no-ops, even with null pointers.
  CopyBlock empty{nullptr, nullptr, 0};
  t = cs.submit({&empty, 1});
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_TRUE(cs.wait(t.value(), kWait).ok());

  // A malformed diagnostic knob is an error, not silently ignored.
  setenv("FERRY_GATHER_HOST_LOAD", "fastest", 1);
  Result<std::unique_ptr<CopyStream>> knob = CopyStream::create(0, {});
  unsetenv("FERRY_GATHER_HOST_LOAD");
  ASSERT_FALSE(knob.ok());
  EXPECT_EQ(knob.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(knob.status().message().find("FERRY_GATHER_HOST_LOAD"), std::string::npos);

  // Bad device ordinal.
  Result<std::unique_ptr<CopyStream>> bad = CopyStream::create(cuda_device_count(), {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

TEST_F(GpuTest, PeerGpuCopy) {
  if (cuda_device_count() < 2) {
    GTEST_SKIP() << "skipped: needs 2 GPUs, " << cuda_device_count() << " visible";
  }
  const size_t n = 4 << 20;
  void *d0 = nullptr, *d1 = nullptr;
  FERRY_CUDA_OK(cudaSetDevice(0));
  FERRY_CUDA_OK(cudaMalloc(&d0, n));
  FERRY_CUDA_OK(cudaSetDevice(1));
  FERRY_CUDA_OK(cudaMalloc(&d1, n));
  FERRY_CUDA_OK(cudaMemset(d1, 0, n));
  FERRY_CUDA_OK(cudaSetDevice(0));
  std::vector<uint8_t> data(n), got(n);
  std::mt19937_64 rng(11);
  for (auto& x : data) x = static_cast<uint8_t>(rng());
  FERRY_CUDA_OK(cudaMemcpy(d0, data.data(), n, cudaMemcpyHostToDevice));
  FERRY_CUDA_OK(cudaDeviceSynchronize());
  FERRY_CUDA_OK(cudaSetDevice(1));
  FERRY_CUDA_OK(cudaDeviceSynchronize());
  FERRY_CUDA_OK(cudaSetDevice(0));
  std::vector<CopyBlock> blocks;
  for (size_t i = 0; i < n / 4096; ++i) {
    blocks.push_back(
        {static_cast<uint8_t*>(d1) + i * 4096, static_cast<uint8_t*>(d0) + i * 4096, 4096});
  }
  Result<std::unique_ptr<CopyStream>> cs = CopyStream::create(0, CopyOptions{});
  ASSERT_TRUE(cs.ok());
  Result<uint64_t> t = cs.value()->submit(blocks);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_TRUE(cs.value()->wait(t.value(), kWait).ok());
  FERRY_CUDA_OK(cudaMemcpy(got.data(), d1, n, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(got == data);
  cudaFree(d0);
  cudaFree(d1);
}

}  // namespace
}  // namespace ferry
