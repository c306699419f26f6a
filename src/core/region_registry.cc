#include "core/region_registry.h"

#include <thread>

#include "core/random_bytes.h"
#include "core/siphash.h"
#include "fmt/format.h"

namespace ferry {
namespace {

MemoryKindInfo host_only_detector(const void*) {
  return {};
}
std::atomic<MemoryKindDetector> g_detector{&host_only_detector};

// a+b <= limit without overflowing.
bool fits(uint64_t offset, uint64_t length, uint64_t limit) {
  return offset <= limit && length <= limit - offset;
}

}  // namespace

void set_memory_kind_detector(MemoryKindDetector detector) {
  g_detector.store(detector ? detector : &host_only_detector);
}

RegionPin::RegionPin(std::shared_ptr<Region> r) : region_(std::move(r)) {
  if (region_) region_->active_ops.fetch_add(1, std::memory_order_acq_rel);
}
RegionPin& RegionPin::operator=(RegionPin&& other) noexcept {
  if (this != &other) {
    release();
    region_ = std::move(other.region_);
  }
  return *this;
}
RegionPin::~RegionPin() {
  release();
}
void RegionPin::release() {
  if (region_) {
    region_->active_ops.fetch_sub(1, std::memory_order_acq_rel);
    region_.reset();
  }
}

Result<MemoryRegion> RegionRegistry::add(void* address, uint64_t length) {
  if (address == nullptr) return err::InvalidArgument("register_memory: address is null");
  if (length == 0) return err::InvalidArgument("register_memory: length is 0");
  const auto base = reinterpret_cast<uintptr_t>(address);
  if (base + length < base) {
    return err::InvalidArgument(
        fmt::format("register_memory: [{:#x}, +{}) wraps the address space", base, length));
  }
  auto region = std::make_shared<Region>();
  const MemoryKindInfo kind = g_detector.load()(address);
  region->info.address = address;
  region->info.length = length;
  region->info.kind = kind.kind;
  region->info.device = kind.device;
  region->gpu_pci = kind.gpu_pci;
  if (Status s = random_bytes(region->secret, sizeof region->secret); !s.ok()) {
    return err::Internal("register_memory: no secret for the region: " + s.message());
  }

  std::unique_lock lock(mu_);
  // Regions may overlap (the same buffer registered twice is legal, as in
  // UCCL); find_local picks one containing the range.
  region->info.id = next_id_++;
  by_id_[region->info.id] = region;
  by_address_.emplace(base, region);
  return region->info;
}

Status RegionRegistry::remove(RegionId id, const std::function<void()>& release) {
  std::shared_ptr<Region> region;
  {
    std::unique_lock lock(mu_);
    auto it = by_id_.find(id);
    if (it == by_id_.end()) {
      return err::NotFound(fmt::format("region {} is not registered (already deregistered?)", id));
    }
    region = it->second;
    by_id_.erase(it);
    const auto base = reinterpret_cast<uintptr_t>(region->info.address);
    auto [lo, hi] = by_address_.equal_range(base);
    for (auto a = lo; a != hi; ++a) {
      if (a->second == region) {
        by_address_.erase(a);
        break;
      }
    }
  }
  // Revoked: no new op can find it. Operations already placing bytes hold a
  // pin; wait for them so the caller may free the memory when we return.
  // Their owners are asked to let go (a frame from a stalled peer would
  // otherwise hold the region until that peer moves again).
  region->revoked.store(true, std::memory_order_release);
  auto next_release = std::chrono::steady_clock::time_point{};
  while (region->active_ops.load(std::memory_order_acquire) != 0) {
    if (release && std::chrono::steady_clock::now() >= next_release) {
      release();
      next_release = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return Status::Ok();
}

std::shared_ptr<Region> RegionRegistry::find(RegionId id) const {
  std::shared_lock lock(mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

size_t RegionRegistry::size() const {
  std::shared_lock lock(mu_);
  return by_id_.size();
}

uint64_t RegionRegistry::compute_key(const Region& region, uint64_t adv_offset, uint64_t adv_length,
                                     uint8_t access) {
  static_assert(sizeof region.secret == kSipHashKeyBytes);
  uint8_t msg[8 * 3 + 1];
  std::memcpy(msg, &region.info.id, 8);
  std::memcpy(msg + 8, &adv_offset, 8);
  std::memcpy(msg + 16, &adv_length, 8);
  msg[24] = access;
  return siphash24(region.secret, msg);
}

Result<RemoteDescriptor> RegionRegistry::advertise(uint64_t engine_id, RegionId id, uint64_t offset,
                                                   uint64_t length, uint8_t access) const {
  auto region = find(id);
  if (!region) return err::NotFound(fmt::format("advertise: region {} is not registered", id));
  if (access == 0 || access > kAccessReadWrite) {
    return err::InvalidArgument(fmt::format("advertise: invalid access {}", access));
  }
  const uint64_t size = region->info.length;
  if (offset > size) {
    return err::OutOfRange(fmt::format(
        "advertise: offset {} is past the end of region {} (length {})", offset, id, size));
  }
  if (length == UINT64_MAX) length = size - offset;
  if (!fits(offset, length, size)) {
    return err::OutOfRange(fmt::format("advertise: [{}, {}+{}) exceeds region {} of length {}",
                                       offset, offset, length, id, size));
  }
  RemoteDescriptor d;
  d.engine_id = engine_id;
  d.region_id = id;
  d.address = reinterpret_cast<uint64_t>(region->info.address) + offset;
  d.region_offset = offset;
  d.length = length;
  d.access = access;
  d.kind = region->info.kind;
  d.device = region->info.device;
  d.gpu_pci = region->gpu_pci;
  d.key = compute_key(*region, offset, length, access);
  return d;
}

Result<uint8_t*> RegionRegistry::check_remote(const RemoteAccessRequest& req, uint8_t wanted,
                                              RegionPin* pin) const {
  // Pin while holding the lock remove() needs to revoke: either remove() runs
  // first and we find nothing, or it sees our pin and waits for it. Finding
  // and pinning in two steps would let remove() return between them.
  std::shared_ptr<Region> region;
  RegionPin held;
  {
    std::shared_lock lock(mu_);
    auto it = by_id_.find(req.region_id);
    if (it != by_id_.end()) {
      region = it->second;
      held = RegionPin(region);
    }
  }
  if (!region) {
    return err::NotFound(
        fmt::format("region {} is not registered on the target (deregistered?)", req.region_id));
  }
  if (req.access == 0 || req.access > kAccessReadWrite ||
      compute_key(*region, req.adv_offset, req.adv_length, req.access) != req.key) {
    return err::PermissionDenied(fmt::format(
        "access key mismatch for region {} (advertised [{}, +{}) {}): the descriptor was not "
        "issued by this engine for this range",
        req.region_id, req.adv_offset, req.adv_length, access_name(req.access)));
  }
  if ((req.access & wanted) != wanted) {
    return err::PermissionDenied(fmt::format("region {} was advertised for {} access, not {}",
                                             req.region_id, access_name(req.access),
                                             access_name(wanted)));
  }
  // A key can only be issued for a range inside the region, but check anyway:
  // the region's length is the last line of defence.
  if (!fits(req.adv_offset, req.adv_length, region->info.length) ||
      !fits(req.offset, req.length, req.adv_length)) {
    return err::OutOfRange(fmt::format(
        "region {}: op [{}, +{}) is outside the advertised range of {} bytes (region length {})",
        req.region_id, req.offset, req.length, req.adv_length, region->info.length));
  }
  auto* addr = static_cast<uint8_t*>(region->info.address) + req.adv_offset + req.offset;
  if (pin) *pin = std::move(held);
  return addr;
}

Result<MemoryRegion> RegionRegistry::find_local(const void* address, uint64_t length) const {
  const auto a = reinterpret_cast<uintptr_t>(address);
  std::shared_lock lock(mu_);
  auto it = by_address_.upper_bound(a);
  // Walk down over regions starting at or below `a`; overlapping registrations
  // are rare, so this is one step in practice (bounded for the pathological case).
  for (int steps = 0; steps < 64 && it != by_address_.begin(); ++steps) {
    --it;
    const auto& info = it->second->info;
    const auto base = reinterpret_cast<uintptr_t>(info.address);
    if (a - base <= info.length && length <= info.length - (a - base)) return info;
  }
  return err::NotFound(
      fmt::format("local buffer [{:#x}, +{}) is not inside any registered region", a, length));
}

}  // namespace ferry
