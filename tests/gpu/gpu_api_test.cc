// The GPU API where no GPU answers: every entry point says NotSupported with
// the reason, nothing crashes. Runs in builds with and without CUDA; on a
// machine with a GPU it is run again with CUDA_VISIBLE_DEVICES=-1.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include "cuda/cuda_detect.h"
#include "ferry/gpu.h"

namespace ferry {
namespace {

class GpuApiNoDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_available(&reason_)) {
      ASSERT_EQ(std::getenv("FERRY_EXPECT_NO_GPU"), nullptr)
          << "CUDA_VISIBLE_DEVICES=-1 should hide every device";
      GTEST_SKIP() << "skipped: a CUDA device is present (" << cuda_device_count()
                   << "); the no-device path is checked with CUDA_VISIBLE_DEVICES=-1";
    }
    std::cout << "no GPU here: " << reason_ << "\n";
  }
  std::string reason_;
};

TEST_F(GpuApiNoDevice, ReasonSaysWhy) {
  EXPECT_FALSE(reason_.empty());
  EXPECT_EQ(cuda_device_count(), 0);
#if FERRY_TEST_BUILT_WITH_CUDA
  EXPECT_EQ(reason_.rfind("no CUDA device", 0), 0u) << reason_;
#else
  EXPECT_EQ(reason_, "built without CUDA support");
#endif
  std::string again;
  EXPECT_FALSE(cuda_available(&again));
  EXPECT_EQ(again, reason_);
  EXPECT_FALSE(cuda_available());  // reason is optional
}

TEST_F(GpuApiNoDevice, CopyStreamCreateIsNotSupported) {
  for (int device : {0, 1, -1}) {
    Result<std::unique_ptr<CopyStream>> r = CopyStream::create(device, CopyOptions{});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kNotSupported) << r.status().to_string();
    EXPECT_NE(r.status().message().find(reason_), std::string::npos) << r.status().to_string();
  }
}

TEST_F(GpuApiNoDevice, CopyBlocksIsNotSupported) {
  char a[16] = {}, b[16] = {1};
  CopyBlock blk{a, b, sizeof a};
  Status s = copy_blocks({&blk, 1});
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.to_string();
  EXPECT_NE(s.message().find(reason_), std::string::npos) << s.to_string();
  EXPECT_EQ(a[0], 0);  // nothing copied
  CopyOptions engine_only;
  engine_only.sm_budget = 0;
  EXPECT_EQ(copy_blocks({&blk, 1}, engine_only, 0).code(), StatusCode::kNotSupported);
}

TEST_F(GpuApiNoDevice, DetectorSaysHost) {
  int x = 0;
  MemoryKindInfo k = cuda_detect_memory_kind(&x);
  EXPECT_EQ(k.kind, MemoryKind::kHost);
  EXPECT_EQ(k.device, -1);
  EXPECT_EQ(cuda_detect_memory_kind(nullptr).kind, MemoryKind::kHost);
  Result<CudaPointerInfo> info = cuda_pointer_info(&x);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), StatusCode::kNotSupported);
}

TEST(GpuApi, DefaultOptions) {
  CopyOptions o;
  EXPECT_GT(o.sm_budget, 0u);
  EXPECT_GT(o.kernel_max_block, 4096u);
  EXPECT_TRUE(o.use_batch_api);
  EXPECT_EQ(cuda_memory_type_name(CudaMemoryType::kPinnedHost), "pinned host");
}

}  // namespace
}  // namespace ferry
