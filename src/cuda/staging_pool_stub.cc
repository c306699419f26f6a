// StagingPool in a build without CUDA: creation answers NotSupported.
#include <string>

#include "cuda/staging_pool.h"

namespace ferry {

#include "cuda/staging_pool_common.inc"

Result<std::unique_ptr<StagingPool>> StagingPool::create(size_t, size_t) {
  return err::NotSupported("GPU staging: built without CUDA support");
}

StagingPool::~StagingPool() = default;

}  // namespace ferry
