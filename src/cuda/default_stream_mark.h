// A point in the work a caller queued on GPUs' legacy default streams, so
// that a copy submitted later is ordered after that work and nothing else.
//
// The landing copy of a read into GPU memory over a host-only transport (tcp,
// staged fabric) is submitted when the data arrives, long after the read was
// posted. Work the caller queued on the default stream before posting -- a
// cudaMemset or a PyTorch zero_() of the destination -- must run before it,
// or it overwrites the bytes read (gpu.two_gpus.TcpGpuCancel failed so under
// `ctest -j4`). Ordering the copy after the default stream as it is when the
// data arrives would also make it wait for what the caller queued after the
// read (a forward pass); a mark taken when the read is posted waits for
// exactly the work queued before.
#pragma once

#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "ferry/status.h"

namespace ferry {

class DefaultStreamMark {
 public:
  // The work queued so far on the legacy default stream of each of
  // `devices`. Null when every one of them is idle (nothing to wait for;
  // one cudaStreamQuery per device) or without CUDA.
  static Result<std::shared_ptr<DefaultStreamMark>> take(std::span<const int> devices);
  ~DefaultStreamMark();
  DefaultStreamMark(const DefaultStreamMark&) = delete;
  DefaultStreamMark& operator=(const DefaultStreamMark&) = delete;

  // Makes `stream` (a cudaStream_t of `device`) wait for the marked work of
  // `device`, if any; work submitted to it afterwards runs after that work.
  Status order(int device, void* stream) const;

 private:
  DefaultStreamMark() = default;
  std::vector<std::pair<int, void*>> events_;  // (device, cudaEvent_t)
};

}  // namespace ferry
