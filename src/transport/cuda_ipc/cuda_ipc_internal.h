// Pieces the cuda_ipc transport's files share: the clock, the I/O thread's
// epoll tags and how ids are written in messages.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "fmt/format.h"

namespace ferry::cuda_ipc::internal {

using Clock = std::chrono::steady_clock;

inline constexpr uint64_t kWakeTag = 0;
inline constexpr uint64_t kListenTag = 1;

inline std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

}  // namespace ferry::cuda_ipc::internal
