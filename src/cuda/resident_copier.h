// ResidentCopier: the host side of the resident copy kernel
// (resident_copy_kernel.h). A small copy is posted by writing a slot of a
// ring in mapped host memory; the kernel, launched on demand and staying
// `linger` after its last copy, takes it within a PCIe round trip and writes
// its status back. Its completion is read from host memory: no event, no
// driver call.
//
// Order after the legacy default stream (CopyOptions::after_default_stream):
// where the legacy stream is idle at the post (one cudaStreamQuery, asked after
// the slot is posted so that it overlaps the kernel's taking it; the answer
// follows in the slot's decision word) there is nothing to wait for. Otherwise the copy posted with
// ticket t waits on the GPU for a gate word that cuStreamWriteValue64, queued on the legacy stream
// at the post, sets to t once the work queued there before has run. A gate still shut after
// `gate_wait` (the legacy stream is busy with long work, which might even need the SM this kernel
// holds) defers the copy: the kernel leaves without copying and the caller sends the copy down its
// ordinary stream instead.
//
// Not thread-safe: CopyStream calls it under its own lock.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>

#include "cuda/resident_copy_kernel.h"
#include "ferry/status.h"

namespace ferry::cuda {

class ResidentCopier {
 public:
  struct Options {
    std::chrono::microseconds linger{200};
    std::chrono::microseconds gate_wait{50};
    // Ask the legacy stream first (cudaStreamQuery) and post without a gate
    // when it is idle; false: always the gate (FERRY_RESIDENT_GATE=always).
    bool query_default_stream = true;
  };
  enum class State { kPending, kDone, kDeferred };

  static Result<std::unique_ptr<ResidentCopier>> create(int device, Options options);
  ~ResidentCopier();
  ResidentCopier(const ResidentCopier&) = delete;
  ResidentCopier& operator=(const ResidentCopier&) = delete;

  // Posts a copy of `size` bytes (dst and src 16-byte aligned device
  // addresses); returns its ticket, or 0 when it cannot take the copy now
  // (the ring is full, the gate cannot be queued): the caller copies another
  // way. The current device must be this copier's.
  Result<uint64_t> post(void* dst, const void* src, uint64_t size, bool after_default_stream);

  // Where ticket `t` stands. Relaunches the kernel where it left with
  // postings not taken.
  Result<State> state(uint64_t t);

  uint64_t launches() const { return launches_; }

 private:
  ResidentCopier() = default;
  void refresh_exit();
  // Queues the gate's write of `t` on the legacy stream; false if it failed.
  bool queue_gate(uint64_t t);
  Status launch(uint64_t first_ticket);

  int device_ = 0;
  Options opt_;
  ResidentShared* shared_ = nullptr;      // host address
  ResidentShared* shared_dev_ = nullptr;  // its device address
  uint64_t* gate_ = nullptr;              // device memory
  cudaStream_t stream_ = nullptr;
  void* write_value_ = nullptr;  // cuStreamWriteValue64, null where the driver lacks it
  uint64_t next_ = 1;            // the next ticket to post
  uint64_t epoch_ = 0;           // launches so far (the running one's number)
  bool alive_ = false;           // a kernel launched that has not written its exit
  uint64_t exit_next_ = 1;       // the ticket the last kernel to leave would have taken
  uint64_t launches_ = 0;
  bool broken_ = false;  // a launch failed: nothing more is posted
};

}  // namespace ferry::cuda
