// Registry of local memory regions and the target-side access check.
//
// Each region gets a 128-bit secret from the kernel's CSPRNG (getrandom). The 64-bit
// key in a RemoteDescriptor is SipHash-2-4(secret, region id, advertised
// range, access): the target recomputes it per operation, so a descriptor
// cannot be widened, retargeted or upgraded from read to write, and no per
// advertisement state is kept. Deregistration removes the region (ids are
// never reused) and waits until operations already placing bytes finish.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry {

struct Region {
  MemoryRegion info;
  uint32_t gpu_pci = 0;  // GPU memory: its GPU's PCI bus id, packed (descriptors name it)
  uint8_t secret[16];
  // Remote operations currently touching this region's memory.
  std::atomic<uint32_t> active_ops{0};
  // Set by remove(): holders of a pin must let go as soon as they can
  // (a stalled peer must not keep deregistration waiting).
  std::atomic<bool> revoked{false};
};

// What a remote op names on the wire (every field is untrusted).
struct RemoteAccessRequest {
  RegionId region_id = 0;
  uint64_t adv_offset = 0;  // advertised start within the region
  uint64_t adv_length = 0;
  uint64_t key = 0;
  uint8_t access = 0;   // access the descriptor claims
  uint64_t offset = 0;  // op start, relative to the advertised start
  uint64_t length = 0;
};

// Holds a region's memory live (deregistration waits) until destroyed.
class RegionPin {
 public:
  RegionPin() = default;
  explicit RegionPin(std::shared_ptr<Region> r);
  RegionPin(RegionPin&&) noexcept = default;
  RegionPin& operator=(RegionPin&& other) noexcept;
  ~RegionPin();
  Region* get() const { return region_.get(); }

 private:
  void release();
  std::shared_ptr<Region> region_;
};

class RegionRegistry {
 public:
  // Detects the memory kind through the registered kind detector (host only
  // without CUDA support).
  Result<MemoryRegion> add(void* address, uint64_t length);
  // Revokes the region at once, then waits until no operation touches its
  // memory. While operations still hold it, `release` is called (at once, then
  // every 10 ms) to ask their owners to let go.
  Status remove(RegionId id, const std::function<void()>& release = {});
  std::shared_ptr<Region> find(RegionId id) const;

  Result<RemoteDescriptor> advertise(uint64_t engine_id, RegionId id, uint64_t offset,
                                     uint64_t length, uint8_t access) const;

  // Target-side check of one remote op: region exists, key matches the
  // advertised range and access, op lies inside it, access `wanted` granted.
  // On success returns the local address and pins the region in `pin`.
  Result<uint8_t*> check_remote(const RemoteAccessRequest& req, uint8_t wanted,
                                RegionPin* pin) const;

  // Finds the registered region containing [address, address+length).
  Result<MemoryRegion> find_local(const void* address, uint64_t length) const;

  static uint64_t compute_key(const Region& region, uint64_t adv_offset, uint64_t adv_length,
                              uint8_t access);

  size_t size() const;

 private:
  mutable std::shared_mutex mu_;
  std::unordered_map<RegionId, std::shared_ptr<Region>> by_id_;
  // base → region; a multimap: one buffer may be registered more than once,
  // and a freed-and-reused one again before its old registration goes.
  std::multimap<uintptr_t, std::shared_ptr<Region>> by_address_;
  RegionId next_id_ = 1;
};

// How register_memory learns what kind of memory a pointer is. The CUDA
// support installs a detector at load time; the default says "host".
struct MemoryKindInfo {
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;
  uint32_t gpu_pci = 0;  // the GPU's PCI bus id, packed (pack_pci_bus_id); 0 for host memory
};
using MemoryKindDetector = MemoryKindInfo (*)(const void* address);
void set_memory_kind_detector(MemoryKindDetector detector);

}  // namespace ferry
