// GPU memory for the soak (--memory gpu): cudaMalloc on the worker's GPU and
// a host shadow of the same size. The copies run on the calling thread's
// per-thread stream and are waited for, so a write's source is in place
// before the write is posted and a read's bytes are checked as they landed.
#include <cuda_runtime.h>

#include <vector>

#include "soak_memory.h"

namespace ferry::soak {

namespace {

std::string CudaError(const char* call, cudaError_t e) {
  return std::string(call) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

class GpuMemory : public SoakMemory {
 public:
  GpuMemory(int device, uint64_t size) : device_(device) { size_ = size; }
  ~GpuMemory() override {
    if (data_ != nullptr) {
      (void)cudaSetDevice(device_);
      (void)cudaFree(data_);
    }
  }
  bool Allocate(std::string* error) {
    shadow_.resize(size_);
    host_ = shadow_.data();
    cudaError_t e = cudaSetDevice(device_);
    if (e != cudaSuccess) {
      *error = CudaError("cudaSetDevice", e) + " for GPU " + std::to_string(device_);
      return false;
    }
    void* p = nullptr;
    e = cudaMalloc(&p, size_ == 0 ? 1 : size_);
    if (e != cudaSuccess) {
      *error = CudaError("cudaMalloc", e) + " of " + std::to_string(size_) + " bytes on GPU " +
               std::to_string(device_);
      return false;
    }
    data_ = static_cast<uint8_t*>(p);
    return true;
  }
  bool ToMemory(uint64_t offset, uint64_t length, std::string* error) override {
    return Copy(data_ + offset, host_ + offset, length, cudaMemcpyHostToDevice, error);
  }
  bool FromMemory(uint64_t offset, uint64_t length, std::string* error) override {
    return Copy(host_ + offset, data_ + offset, length, cudaMemcpyDeviceToHost, error);
  }

 private:
  bool Copy(void* to, const void* from, uint64_t length, cudaMemcpyKind kind, std::string* error) {
    if (length == 0) return true;
    // Per thread: a traffic thread starts on device 0 whatever the main thread chose.
    cudaError_t e = cudaSetDevice(device_);
    if (e == cudaSuccess) e = cudaMemcpyAsync(to, from, length, kind, cudaStreamPerThread);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamPerThread);
    if (e != cudaSuccess) {
      *error = CudaError(kind == cudaMemcpyHostToDevice ? "cudaMemcpyAsync to the GPU"
                                                        : "cudaMemcpyAsync from the GPU",
                         e) +
               ", " + std::to_string(length) + " bytes on GPU " + std::to_string(device_);
      return false;
    }
    return true;
  }

  int device_;
  std::vector<uint8_t> shadow_;
};

}  // namespace

std::unique_ptr<SoakMemory> CreateGpuMemory(int device, uint64_t size, std::string* error) {
  auto m = std::make_unique<GpuMemory>(device, size);
  if (!m->Allocate(error)) return nullptr;
  return m;
}

int CountGpus(std::string* error) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *error = CudaError("cudaGetDeviceCount", e);
    return -1;
  }
  return n;
}

}  // namespace ferry::soak
