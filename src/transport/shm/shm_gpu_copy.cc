#include "transport/shm/shm_gpu_copy.h"

#include <cstring>
#include <vector>

#include "cuda/host_device_copy.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"

namespace ferry::shm {
namespace {

// Host bytes between a region (or a caller's buffer) and a staging area. A function
// of its own so that tests/tsan.supp can name it: these are the writes into
// registered memory that a remote initiator orders (see there).
[[gnu::noinline]] void copy_staged_piece(uint8_t* to, const uint8_t* from, size_t length) {
  std::memcpy(to, from, length);
}

// Pins the area on its first GPU copy in this process; once refused, not
// asked again (the copies then run from pageable memory, slower).
void pin_once(Connection& c, bool own) {
  std::lock_guard lock(c.pin_mu);
  int& state = own ? c.own_pinned : c.theirs_pinned;
  if (state != 0) return;
  const StagingArea& area = own ? c.own : c.theirs;
  const Status s = cuda_pin_host_range(area.data(), area.size());
  state = s.ok() ? 1 : -1;
  if (!s.ok()) {
    spdlog::warn(
        "ferry shm: could not pin the {} staging area of peer {:016x} ({} bytes) for GPU "
        "copies: {}; GPU memory goes through it unpinned (slower)",
        own ? "own" : "peer's", c.peer, area.size(), s.message());
  }
}

}  // namespace

Status copy_through_area(Connection& c, bool own, std::span<const CopyPiece> pieces,
                         std::span<const int> devices, bool to_area,
                         const DefaultStreamMark* after) {
  uint8_t* area = own ? c.own.data() : c.theirs.data();
  std::vector<HostDeviceCopy> gpu;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const CopyPiece& p = pieces[i];
    const int device = i < devices.size() ? devices[i] : -1;
    if (device < 0) {
      if (to_area) {
        copy_staged_piece(area + p.remote, p.local, p.length);
      } else {
        copy_staged_piece(p.local, area + p.remote, p.length);
      }
      continue;
    }
    gpu.push_back({p.local, area + p.remote, p.length, device, /*to_device=*/!to_area});
  }
  if (gpu.empty()) return Status::Ok();
  pin_once(c, own);
  if (Status s = cuda_copy_now(gpu, after); !s.ok()) {
    return Status(s.code(), fmt::format("shm: GPU memory {} the staging area of peer {:016x}: {}",
                                        to_area ? "into" : "out of", c.peer, s.message()));
  }
  return Status::Ok();
}

}  // namespace ferry::shm
