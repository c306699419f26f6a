// The GPU entry points of a build without CUDA: each answers NotSupported
// (or "host memory" for the kind detector) with the reason, so callers need
// no #ifdefs.
#include <string>

#include "cuda/cuda_detect.h"
#include "cuda/default_stream_mark.h"
#include "cuda/host_device_copy.h"
#include "ferry/gpu.h"

namespace ferry {
namespace {
constexpr const char* kReason = "built without CUDA support";
}  // namespace

bool cuda_available(std::string* reason) {
  if (reason != nullptr) *reason = kReason;
  return false;
}

int cuda_device_count() {
  return 0;
}

Result<std::vector<GpuIdentity>> gpu_identities() {
  return err::NotSupported(kReason);
}

#include "cuda/memory_type_names.inc"

Result<CudaPointerInfo> cuda_pointer_info(const void*) {
  return err::NotSupported(kReason);
}

uint32_t cuda_device_pci(int) {
  return 0;
}

MemoryKindInfo cuda_detect_memory_kind(const void*) {
  return MemoryKindInfo{};
}

struct CopyStream::Impl {
  int device = 0;
  CopyOptions opts;
};

CopyStream::CopyStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CopyStream::~CopyStream() = default;

Result<std::unique_ptr<CopyStream>> CopyStream::create(int, CopyOptions) {
  return err::NotSupported(kReason);
}

// Unreachable (no CopyStream can be created), but defined for the linker.
Result<uint64_t> CopyStream::submit(std::span<const CopyBlock>, BlockCheck) {
  return err::NotSupported(kReason);
}
Status CopyStream::poll(uint64_t) {
  return err::NotSupported(kReason);
}
Status CopyStream::wait(uint64_t, std::chrono::milliseconds) {
  return err::NotSupported(kReason);
}
uint64_t CopyStream::completed_through() {
  return 0;
}
uint64_t CopyStream::last_submitted() const {
  return 0;
}
int CopyStream::device() const {
  return impl_->device;
}
const CopyOptions& CopyStream::options() const {
  return impl_->opts;
}
void* CopyStream::native_stream() const {
  return nullptr;
}
CopyStreamStats CopyStream::stats() {
  return {};
}

Status copy_blocks(std::span<const CopyBlock>, const CopyOptions&, int) {
  return err::NotSupported(kReason);
}

Status cuda_pin_host_range(void*, uint64_t) {
  return err::NotSupported(kReason);
}
void cuda_unpin_host_range(void*) {}
Status cuda_copy_now(std::span<const HostDeviceCopy> copies, const DefaultStreamMark*) {
  if (copies.empty()) return Status::Ok();
  return err::NotSupported(kReason);
}

Result<std::shared_ptr<DefaultStreamMark>> DefaultStreamMark::take(std::span<const int>) {
  return std::shared_ptr<DefaultStreamMark>();  // no GPU work to wait for
}
DefaultStreamMark::~DefaultStreamMark() = default;
Status DefaultStreamMark::order(int, void*) const {
  return Status::Ok();
}

}  // namespace ferry
