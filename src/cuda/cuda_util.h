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

// Makes `device` current for the scope -- its primary context bound to this
// thread -- and restores the caller's device afterwards (the thread may be
// driving another GPU).
//
// cudaSetDevice is called even when cudaGetDevice already names `device`:
// cudaGetDevice answers 0 on a thread that has never made a CUDA call, and
// such a thread has no current context. Queries that answer per context then
// come back empty -- cudaPointerGetAttributes gives devicePointer == NULL for
// mapped pinned host memory -- which made the tcp transport's staging copies
// (submitted from its own threads) fail with "pinned host memory not mapped
// for the GPU". Since CUDA 12, cudaSetDevice binds the primary context at
// once; on a thread where it is already bound it is cheap. (Skipping it when
// cudaGetDevice named the device already brought the failure back, and
// cuMemGetAddressRange failed with CUDA_ERROR_INVALID_CONTEXT for VMM memory.)
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != device_ && status_ == cudaSuccess) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int device_;
  int prev_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace ferry::cuda
