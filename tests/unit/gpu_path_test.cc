// engine.gpu_same_host_path: its values, the refusal of any other naming the
// option and the choices (at Engine::create), and which transports each value
// lets carry GPU memory.
#include "core/gpu_path.h"

#include <gtest/gtest.h>

#include "ferry/engine.h"

namespace ferry {
namespace {

TEST(GpuSameHostPath, ParsesEveryValueAndNamesThemBack) {
  for (const char* v : {"auto", "cuda_ipc", "shm_staged", "tcp"}) {
    auto p = parse_gpu_same_host_path(v);
    ASSERT_TRUE(p.ok()) << v;
    EXPECT_EQ(gpu_same_host_path_name(*p), v);
  }
}

TEST(GpuSameHostPath, RefusesOtherValuesNamingTheOptionAndChoices) {
  for (const char* v : {"", "shm", "CUDA_IPC", "staged", "auto "}) {
    auto p = parse_gpu_same_host_path(v);
    ASSERT_FALSE(p.ok()) << v;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find("engine.gpu_same_host_path"), std::string::npos);
    EXPECT_NE(p.status().message().find(std::string("'") + v + "'"), std::string::npos);
    EXPECT_NE(p.status().message().find("auto, cuda_ipc, shm_staged, tcp"), std::string::npos);
  }
}

TEST(GpuSameHostPath, EngineCreateRefusesABadValue) {
  EngineConfig config;
  config.options["engine.gpu_same_host_path"] = "loopback";
  auto e = Engine::create(config);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("'loopback'"), std::string::npos) << e.status().to_string();
  config.options["engine.gpu_same_host_path"] = "shm_staged";
  config.options["engine.transports"] = "tcp";
  auto good = Engine::create(config);
  EXPECT_TRUE(good.ok()) << good.status().to_string();
}

TEST(GpuSameHostPath, EachValueLetsExactlyItsTransportCarryGpuMemory) {
  using P = GpuSameHostPath;
  // Same-host transports: cuda_ipc and shm. A network transport always may.
  EXPECT_TRUE(gpu_path_allows(P::kAuto, "cuda_ipc", true));
  EXPECT_TRUE(gpu_path_allows(P::kAuto, "shm", true));
  EXPECT_TRUE(gpu_path_allows(P::kCudaIpc, "cuda_ipc", true));
  EXPECT_FALSE(gpu_path_allows(P::kCudaIpc, "shm", true));
  EXPECT_FALSE(gpu_path_allows(P::kShmStaged, "cuda_ipc", true));
  EXPECT_TRUE(gpu_path_allows(P::kShmStaged, "shm", true));
  EXPECT_FALSE(gpu_path_allows(P::kTcp, "cuda_ipc", true));
  EXPECT_FALSE(gpu_path_allows(P::kTcp, "shm", true));
  for (P p : {P::kAuto, P::kCudaIpc, P::kShmStaged, P::kTcp}) {
    EXPECT_TRUE(gpu_path_allows(p, "tcp", false));
    EXPECT_TRUE(gpu_path_allows(p, "fabric", false));
  }
  EXPECT_TRUE(shm_stages_gpu(P::kAuto));
  EXPECT_TRUE(shm_stages_gpu(P::kShmStaged));
  EXPECT_FALSE(shm_stages_gpu(P::kCudaIpc));
  EXPECT_FALSE(shm_stages_gpu(P::kTcp));
}

}  // namespace
}  // namespace ferry
