// Small helpers shared by the CUDA sources: cudaError_t -> Status, and a
// guard that makes a device current and restores the caller's afterwards.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "ferry/status.h"

namespace ferry::cuda {

// "cudaMemcpyBatchAsync: cudaErrorInvalidValue (invalid argument)".
inline std::string cuda_error_text(cudaError_t e, const char* what) {
  std::string s(what);
  s += ": ";
  s += cudaGetErrorName(e);
  s += " (";
  s += cudaGetErrorString(e);
  s += ")";
  return s;
}

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  switch (e) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
      return err::InvalidArgument(cuda_error_text(e, what));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNotSupported:
    case cudaErrorCallRequiresNewerDriver:
      return err::NotSupported(cuda_error_text(e, what));
    default:
      return err::Internal(cuda_error_text(e, what));
  }
}

// Makes `device` current for the scope; restores the previous one (the
// caller's thread may be driving another GPU).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && status_ == cudaSuccess) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int prev_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace ferry::cuda
