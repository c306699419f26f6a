#include "core/transport_set.h"

#include <algorithm>

#include "fmt/format.h"
#include "fmt/ranges.h"
#include "spdlog/spdlog.h"

namespace ferry {
namespace {

std::string hex_peer(PeerId id) {
  return fmt::format("{:016x}", id);
}

// `peer_gpu`: some iov of the call has GPU memory on the peer's side (always
// so for kPeerGpu).
bool can_carry(const TransportCaps& caps, MemoryRoute route, bool host_pairs = false,
               bool peer_gpu = false) {
  switch (route) {
    case MemoryRoute::kHostOnly:
      return caps.host_memory;
    case MemoryRoute::kPeerGpu:
      return caps.cuda_memory && !caps.local_gpu_only;
    case MemoryRoute::kGpuToPeerHost:
      return caps.cuda_memory && (!caps.cuda_peer_only || (caps.gpu_to_peer_host && !host_pairs)) &&
             !(caps.local_gpu_only && peer_gpu);
  }
  return false;
}

std::vector<std::string> split_names(const std::string& text) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= text.size()) {
    size_t comma = text.find(',', at);
    if (comma == std::string::npos) comma = text.size();
    std::string name = text.substr(at, comma - at);
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (!name.empty()) out.push_back(std::move(name));
    at = comma + 1;
  }
  return out;
}

}  // namespace

std::string_view memory_route_name(MemoryRoute route) {
  switch (route) {
    case MemoryRoute::kHostOnly:
      return "host memory";
    case MemoryRoute::kPeerGpu:
      return "peer GPU memory";
    case MemoryRoute::kGpuToPeerHost:
      return "local GPU with peer host memory";
  }
  return "?";
}

Status TransportSet::start(
    const std::string& selection, const TransportContext& base,
    const std::function<std::unique_ptr<TransportEvents>(std::string_view)>& make_events) {
  const bool automatic = selection == "auto";
  std::vector<const TransportRegistration*> wanted;
  if (automatic) {
    for (const auto& r : registered_transports()) wanted.push_back(&r);
  } else {
    for (const std::string& name : split_names(selection)) {
      const TransportRegistration* r = find_transport(name);
      if (!r) {
        std::string known;
        for (const auto& t : registered_transports()) known += (known.empty() ? "" : ", ") + t.name;
        return err::InvalidArgument(
            fmt::format("option engine.transports: no transport '{}' (built in: {})", name, known));
      }
      if (std::find(wanted.begin(), wanted.end(), r) == wanted.end()) wanted.push_back(r);
    }
    if (wanted.empty()) {
      return err::InvalidArgument("option engine.transports: names no transport");
    }
  }
  std::stable_sort(wanted.begin(), wanted.end(),
                   [](const auto* a, const auto* b) { return a->rank < b->rank; });

  for (const TransportRegistration* r : wanted) {
    Running t;
    t.name = r->name;
    t.rank = r->rank;
    t.transport = r->create();
    t.events = make_events(r->name);
    TransportContext ctx = base;
    ctx.events = t.events.get();
    Status s = t.transport->start(ctx);
    if (!s.ok()) {
      // Under "auto" a transport that cannot work on this machine
      // (NotSupported) is left out and reported; a bad setting (a listen
      // address in use, say) is the caller's error either way.
      if (!automatic || s.code() != StatusCode::kNotSupported) {
        shutdown(err::Cancelled("engine start failed"));
        return Status(s.code(), automatic ? s.message()
                                          : fmt::format("transport {} (named by "
                                                        "engine.transports) cannot start: {}",
                                                        r->name, s.message()));
      }
      spdlog::info("ferry: transport {} not running here: {}", r->name, s.message());
      unavailable_.push_back({r->name, false, false, s.message()});
      continue;
    }
    t.caps = t.transport->capabilities();
    running_.push_back(std::move(t));
  }
  if (running_.empty()) {
    return err::NotSupported("no transport could start: " + (unavailable_.empty()
                                                                 ? std::string("none selected")
                                                                 : unavailable_.front().detail));
  }
  return Status::Ok();
}

void TransportSet::shutdown(const Status& reason) {
  for (Running& t : running_) t.transport->shutdown(reason);
}

std::vector<TransportInfo> TransportSet::describe() const {
  std::vector<TransportInfo> out;
  for (const Running& t : running_) {
    out.push_back({t.name, true, t.caps.same_host_only, t.transport->local_address_text(),
                   t.transport->counters()});
  }
  out.insert(out.end(), unavailable_.begin(), unavailable_.end());
  return out;
}

Transport* TransportSet::network() const {
  for (const Running& t : running_) {
    if (!t.caps.same_host_only && !t.caps.metadata_only) return t.transport.get();
  }
  return nullptr;
}

Transport* TransportSet::find(std::string_view name) const {
  for (const Running& t : running_) {
    if (t.name == name) return t.transport.get();
  }
  return nullptr;
}

bool TransportSet::connected(PeerId peer) const {
  return std::any_of(running_.begin(), running_.end(),
                     [peer](const Running& t) { return t.transport->is_connected(peer); });
}

TransportCaps TransportSet::caps_for(const Running& t, PeerId peer) {
  return t.caps.varies_by_peer ? t.transport->capabilities_for(peer) : t.caps;
}

const TransportSet::Running* TransportSet::pick(PeerId peer, MemoryRoute route, bool host_pairs,
                                                bool peer_gpu) const {
  for (const Running& t : running_) {
    if (route != MemoryRoute::kHostOnly &&
        !gpu_path_allows(gpu_path_, t.name, t.caps.same_host_only)) {
      continue;
    }
    // Host memory never varies by peer: no per-peer question on that path.
    const TransportCaps caps = route == MemoryRoute::kHostOnly ? t.caps : caps_for(t, peer);
    if (can_carry(caps, route, host_pairs, peer_gpu) && t.transport->is_connected(peer)) {
      return &t;
    }
  }
  return nullptr;
}

std::string TransportSet::gpu_staging_reason(PeerId peer, bool* forced) const {
  bool over_shm = false;
  for (MemoryRoute route : kAllRoutes) {
    if (route == MemoryRoute::kHostOnly) continue;
    const Running* t = pick(peer, route);
    over_shm = over_shm || (t != nullptr && t->name == "shm");
  }
  if (forced) *forced = gpu_path_ == GpuSameHostPath::kShmStaged;
  if (!over_shm) return {};
  if (gpu_path_ == GpuSameHostPath::kShmStaged) {
    return fmt::format("{}=shm_staged", kGpuSameHostPathOption);
  }
  for (const TransportInfo& u : unavailable_) {
    if (u.name == "cuda_ipc") return "cuda_ipc does not run here: " + u.detail;
  }
  const Running* ipc = nullptr;
  for (const Running& t : running_) {
    if (t.name == "cuda_ipc") ipc = &t;
  }
  if (ipc == nullptr) return "cuda_ipc does not run here";
  if (!ipc->transport->is_connected(peer)) {
    std::lock_guard lock(mu_);
    if (auto n = unused_.find(peer); n != unused_.end()) {
      if (auto r = n->second.find("cuda_ipc"); r != n->second.end()) {
        return "cuda_ipc is not connected: " + r->second;
      }
    }
    return "cuda_ipc is not connected";
  }
  // Connected, yet some GPU route goes over shm: one cuda_ipc cannot carry
  // (a batch with host memory on both sides of some iov).
  return "cuda_ipc does not carry every GPU route to this peer";
}

Result<Transport*> TransportSet::choose(PeerId peer, MemoryRoute route, bool host_pairs,
                                        bool peer_gpu) const {
  if (const Running* t = pick(peer, route, host_pairs, peer_gpu)) return t->transport.get();
  std::string connected;
  for (const Running& t : running_) {
    if (t.transport->is_connected(peer)) connected += (connected.empty() ? "" : ", ") + t.name;
  }
  return err::NotSupported(fmt::format(
      "{} to peer {}: no connected transport carries it (connected: {}); see peer_transports()",
      memory_route_name(route), hex_peer(peer), connected.empty() ? "none" : connected));
}

void TransportSet::note_unused(PeerId peer, std::string_view transport, std::string reason) {
  std::lock_guard lock(mu_);
  unused_[peer][std::string(transport)] = std::move(reason);
}

void TransportSet::clear_unused(PeerId peer, std::string_view transport) {
  std::lock_guard lock(mu_);
  auto it = unused_.find(peer);
  if (it == unused_.end()) return;
  if (auto r = it->second.find(transport); r != it->second.end()) it->second.erase(r);
}

void TransportSet::forget(PeerId peer) {
  std::lock_guard lock(mu_);
  unused_.erase(peer);
}

std::vector<PeerTransportInfo> TransportSet::describe_peer(PeerId peer) const {
  const Running* chosen[std::size(kAllRoutes)];
  for (size_t r = 0; r < std::size(kAllRoutes); ++r) chosen[r] = pick(peer, kAllRoutes[r]);
  std::vector<TransportCaps> caps;
  std::vector<std::string> limits;
  for (const Running& t : running_) {
    caps.push_back(caps_for(t, peer));
    limits.push_back(t.transport->peer_limits(peer));
  }
  const std::string staging_why = gpu_staging_reason(peer);
  std::lock_guard lock(mu_);
  const auto notes = unused_.find(peer);
  std::vector<PeerTransportInfo> out;
  for (size_t k = 0; k < running_.size(); ++k) {
    const Running& t = running_[k];
    PeerTransportInfo info;
    info.transport = t.name;
    info.connected = t.transport->is_connected(peer);
    std::vector<std::string> carries;
    std::vector<std::string> taken;  // what it could carry but another transport takes
    bool cannot_gpu = true;
    for (size_t r = 0; r < std::size(kAllRoutes); ++r) {
      const MemoryRoute route = kAllRoutes[r];
      if (chosen[r] == &t) {
        carries.emplace_back(memory_route_name(route));
      } else if (route != MemoryRoute::kHostOnly && can_carry(caps[k], route) &&
                 !gpu_path_allows(gpu_path_, t.name, t.caps.same_host_only)) {
        taken.push_back(fmt::format("{} not by {} ({}={})", memory_route_name(route), t.name,
                                    kGpuSameHostPathOption, gpu_same_host_path_name(gpu_path_)));
      } else if (can_carry(caps[k], route) && chosen[r] != nullptr) {
        taken.push_back(fmt::format("{} carries {}", chosen[r]->name, memory_route_name(route)));
      }
      if (route != MemoryRoute::kHostOnly && can_carry(caps[k], route)) cannot_gpu = false;
    }
    info.carries = fmt::format("{}", fmt::join(carries, ", "));
    if (info.connected) info.via = t.transport->peer_address(peer);
    const bool carries_gpu = std::any_of(std::begin(kAllRoutes), std::end(kAllRoutes), [&](auto r) {
      return r != MemoryRoute::kHostOnly && chosen[static_cast<size_t>(r)] == &t;
    });
    if (info.connected && t.name == "shm" && carries_gpu && !staging_why.empty()) {
      info.via += fmt::format(" (GPU memory staged: {})", staging_why);
    }
    if (!info.connected) {
      if (notes != unused_.end()) {
        if (auto n = notes->second.find(t.name); n != notes->second.end()) info.reason = n->second;
      }
      if (info.reason.empty()) info.reason = "not connected to this peer";
    } else if (carries.size() < std::size(kAllRoutes)) {
      if (cannot_gpu) taken.push_back("carries no GPU memory");
      if (!limits[k].empty()) taken.push_back(limits[k]);
      info.reason = fmt::format("{}", fmt::join(taken, "; "));
    }
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace ferry
