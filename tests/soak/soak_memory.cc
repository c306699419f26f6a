// Host memory for the soak, the choice between host and GPU memory, and the
// GPU each worker uses (the GPU memory itself: soak_memory_cuda.cc).
#include "soak_memory.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "../integration/test_util.h"

namespace ferry::soak {

namespace {

// Host memory: the engine moves the very bytes the soak checks.
class HostMemory : public SoakMemory {
 public:
  explicit HostMemory(uint64_t size) : buffer_(size) {
    data_ = host_ = buffer_.data();
    size_ = size;
    // Touch every page now: peers write a target area's slots at random, so
    // its pages would otherwise enter the RSS over minutes after a (re)start,
    // and the soak's RSS check would count the soak's own buffers as growth.
    std::memset(data_, 0, size);
  }
  bool ToMemory(uint64_t, uint64_t, std::string*) override { return true; }
  bool FromMemory(uint64_t, uint64_t, std::string*) override { return true; }

 private:
  itest::Buffer buffer_;
};

}  // namespace

std::unique_ptr<SoakMemory> SoakMemory::Create(const SoakConfig& config, int device, uint64_t size,
                                               std::string* error) {
  if (config.memory == "gpu") return CreateGpuMemory(device, size, error);
  return std::make_unique<HostMemory>(size);
}

int SelectGpu(const SoakConfig& config, int index, std::string* error) {
  if (config.gpus <= 0) {
    *error = "no GPU to put worker " + std::to_string(index) + " on (--gpus " +
             std::to_string(config.gpus) + ")";
    return -1;
  }
  const int mine = index % config.gpus;
  if (!config.gpu_isolate) return mine;
  // The mine-th of the GPUs this process was given (the coordinator's
  // CUDA_VISIBLE_DEVICES, inherited), or the mine-th of the host's.
  std::string name = std::to_string(mine);
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible && *visible) {
    std::vector<std::string> names(1);
    for (const char* c = visible; *c != '\0'; ++c) {
      if (*c == ',') {
        names.emplace_back();
      } else {
        names.back() += *c;
      }
    }
    if (static_cast<size_t>(mine) >= names.size()) {
      *error = "worker " + std::to_string(index) + " is to see GPU " + std::to_string(mine) +
               " of CUDA_VISIBLE_DEVICES=" + visible + ", which names only " +
               std::to_string(names.size());
      return -1;
    }
    name = names[mine];
  }
  setenv("CUDA_VISIBLE_DEVICES", name.c_str(), 1);
  return 0;
}

}  // namespace ferry::soak
