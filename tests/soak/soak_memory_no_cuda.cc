// GPU memory in a build without CUDA: --memory gpu is refused with the reason.
#include "soak_memory.h"

namespace ferry::soak {

namespace {
constexpr const char* kReason =
    "ferry-soak was built without CUDA: --memory gpu needs a CUDA build";
}  // namespace

std::unique_ptr<SoakMemory> CreateGpuMemory(int, uint64_t, std::string* error) {
  *error = kReason;
  return nullptr;
}

int CountGpus(std::string* error) {
  *error = kReason;
  return -1;
}

}  // namespace ferry::soak
