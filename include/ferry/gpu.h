// GPU support: run-time detection and the local batched copy (host<->GPU,
// GPU<->GPU, many small blocks per call, stream-ordered).
//
// Every entry point is present in every build. In a build without CUDA, or on
// a machine without a usable GPU/driver, they answer NotSupported with the
// reason ("built without CUDA support", "no CUDA device: ...").
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"

namespace ferry {

// True when this build has CUDA support and at least one device answers.
// Otherwise false, and `reason` (if given) says why.
bool cuda_available(std::string* reason = nullptr);

// Number of visible CUDA devices; 0 without CUDA support, driver or device.
int cuda_device_count();

// A GPU as every process names it, whatever its CUDA_VISIBLE_DEVICES: processes
// launched with different visible sets number GPUs differently, so metadata,
// descriptors and messages carry the UUID and PCI bus id, never an ordinal.
struct GpuIdentity {
  int ordinal = -1;        // this process's CUDA ordinal of it
  std::string uuid;        // "GPU-8f6c0e1a-...", as nvidia-smi -L prints it
  std::string pci_bus_id;  // "0000:18:00.0": domain:bus:device.function, hex
  std::string name;        // "NVIDIA H100 80GB HBM3"
};

// The GPUs this process sees, by ordinal. NotSupported without CUDA support,
// driver or device.
Result<std::vector<GpuIdentity>> gpu_identities();

// This process's ordinal of the GPU named by its UUID ("GPU-..." or the bare
// hex) or its PCI bus id ("0000:18:00.0", any case; "18:00.0" for domain 0).
// NotFound, naming the GPUs this process does see, when it does not see it;
// InvalidArgument when `name` is neither.
Result<int> gpu_ordinal(std::string_view name);

// A PCI bus id packed into 32 bits (domain << 16 | bus << 8 | device << 3 |
// function), as remote descriptors carry it; 0 means "not a GPU / unknown".
uint32_t pack_pci_bus_id(uint32_t domain, uint32_t bus, uint32_t device, uint32_t function);
std::string pci_bus_id_text(uint32_t packed);

// One block of a batched copy. Any direction: host<->device, device<->device
// (same or peer GPU). The blocks of one batch must not overlap each other.
struct CopyBlock {
  void* dst = nullptr;
  const void* src = nullptr;
  uint64_t size = 0;
};

struct CopyOptions {
  // Most SMs the gather/scatter kernel may occupy: it launches at most this
  // many CTAs (one per SM), so it never holds more SMs than this. 0 = never
  // use the kernel; every block goes to the copy engine.
  uint32_t sm_budget = 16;
  // Blocks smaller than this go to the SM kernel (when sm_budget > 0); the
  // rest to the copy engine. Host memory on the kernel path must be pinned
  // (cudaHostAlloc / cudaHostRegister). 512 KiB: on an H100 the kernel beats
  // cudaMemcpyBatchAsync up to 256 KiB blocks, the copy engine wins from 1 MiB
  // (docs/gpu.md).
  uint64_t kernel_max_block = 512 * 1024;
  // Copy-engine blocks: one cudaMemcpyBatchAsync (CUDA >= 12.8) when true, a
  // cudaMemcpyAsync per block otherwise (and always on older CUDA).
  bool use_batch_api = true;
  // Batches start only after work queued before them on the device's legacy
  // default stream (where a PyTorch program's tensors are produced unless it
  // picks another stream): the stream is a blocking one, so work queued there
  // later also waits for them. Off: ordered with nothing else (the caller
  // synchronises).
  bool after_default_stream = false;
  // A lone block of at most this many bytes, device memory on both sides
  // (BlockCheck::kDeviceMemory), 16-byte aligned, submitted while nothing but
  // such blocks is in flight, goes to the resident copy kernel: one CTA that
  // stays on the GPU for resident_linger_us after its last copy and takes the
  // next from mapped host memory, with no launch or driver call (a 4 KiB copy
  // ~2-3 us sooner than cudaMemcpyAsync). It holds one SM while it stays, and
  // a cudaDeviceSynchronize() waits for it to leave. 0 = never.
  uint64_t resident_max_block = 0;
  uint32_t resident_linger_us = 200;
};

// How CopyStream::submit learns what memory a block's pointers name.
enum class BlockCheck : uint8_t {
  // Asks the driver (one query per allocation per call, about 1 us each) and
  // refuses what the kernel path cannot reach (pageable host memory).
  kClassify,
  // The caller vouches that every pointer is device memory of the stream's
  // GPU, or memory mapped into it (IPC), so its address is the device
  // address: nothing is queried. For callers that know, like the cuda_ipc
  // transport, whose latency the queries would dominate.
  kDeviceMemory,
};

// What a CopyStream did so far (for tests, benchmarks, ferry-info).
struct CopyStreamStats {
  uint64_t batches = 0;            // submit() calls that enqueued work
  uint64_t kernel_blocks = 0;      // blocks moved by the SM kernel
  uint64_t engine_blocks = 0;      // blocks moved by the copy engine
  uint64_t kernel_launches = 0;    // kernel launches (a large batch is pipelined)
  uint32_t max_ctas = 0;           // largest grid launched
  uint32_t sms_used = 0;           // distinct SMs the kernel's CTAs ran on
  uint64_t resident_blocks = 0;    // blocks moved by the resident copy kernel
  uint64_t resident_deferred = 0;  // of those, sent to the copy engine after all
};

// One-shot batched copy on `device`: enqueues on a per-device shared stream
// (with these options) and waits for it. Same validation as CopyStream::submit.
Status copy_blocks(std::span<const CopyBlock> blocks, const CopyOptions& options = {},
                   int device = 0);

// An ordered copy stream: batches run in submission order on one CUDA stream
// and complete in that order. Thread-safe. Every pointer in a batch must stay
// valid until its ticket completes.
class CopyStream {
 public:
  // Creates a stream on `device`. NotSupported without CUDA/GPU,
  // InvalidArgument for a bad device ordinal.
  static Result<std::unique_ptr<CopyStream>> create(int device = 0, CopyOptions options = {});

  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  // Validates and enqueues a batch; returns its ticket (1, 2, 3, ...). A block
  // that is invalid (null pointer with size > 0, pageable host memory on the
  // kernel path; OutOfRange past the end of its allocation) fails the call
  // with an error naming the block index and pointer, and no ticket is issued.
  // Blocks are checked while the batch is launched in slices (so that a large
  // batch starts copying at once): kernel-path blocks before the bad one may
  // have been copied when the call returns (those copies have finished then);
  // nothing from the bad block on, and no copy-engine block, is copied.
  Result<uint64_t> submit(std::span<const CopyBlock> blocks,
                          BlockCheck check = BlockCheck::kClassify);

  // Ok once the batch is done, InProgress while it runs, the error if the
  // stream failed, InvalidArgument for a ticket never issued.
  Status poll(uint64_t ticket);

  // Waits until the batch is done, up to `timeout` (Timeout then; the copy
  // goes on).
  Status wait(uint64_t ticket, std::chrono::milliseconds timeout);

  // Highest ticket such that it and every earlier one are done.
  uint64_t completed_through();
  // Last ticket issued (0 before the first submit).
  uint64_t last_submitted() const;

  int device() const;
  const CopyOptions& options() const;
  // The underlying cudaStream_t, so callers can order other work after it
  // (cudaEventRecord / cudaStreamWaitEvent). Owned by this object.
  void* native_stream() const;

  // Counters; reading sms_used waits for the work already enqueued.
  CopyStreamStats stats();

  struct Impl;

 private:
  friend Status copy_blocks(std::span<const CopyBlock>, const CopyOptions&, int);
  explicit CopyStream(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
