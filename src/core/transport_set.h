// The transports one engine runs, and the per-peer choice between them.
//
// The engine starts every transport that `engine.transports` names ("auto":
// every registered one) and that can work here; a transport whose start()
// fails is kept out with the reason. Per peer and per call, the choice is the
// lowest-ranked transport that is connected to the peer and can carry the
// memory kinds involved: same-host transports (rank < 100) before network
// ones. Whatever was not taken, and why, is kept per peer for
// Engine::peer_transports(), ferry-info and ferry-bench.
//
// Policy lives here, not in the transports: a transport only says what it can
// carry (TransportCaps) and whether it is connected to a peer.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/gpu_path.h"
#include "ferry/engine.h"
#include "transport/transport.h"

namespace ferry {

// What one call moves: host memory on both sides; GPU memory on the peer's
// side of every iov (the local side any kind); or some local GPU memory with
// peer host memory. The first route a transport cannot carry goes elsewhere.
enum class MemoryRoute : uint8_t { kHostOnly, kPeerGpu, kGpuToPeerHost };
constexpr MemoryRoute kAllRoutes[] = {MemoryRoute::kHostOnly, MemoryRoute::kPeerGpu,
                                      MemoryRoute::kGpuToPeerHost};
std::string_view memory_route_name(MemoryRoute route);

class TransportSet {
 public:
  struct Running {
    std::string name;
    int rank = 100;
    TransportCaps caps;
    std::unique_ptr<Transport> transport;
    std::unique_ptr<TransportEvents> events;  // tags events with `name`
  };

  // Parses `engine.transports` ("auto" or a comma list of names). Unknown
  // names are errors; a named transport that cannot start is an error too
  // (the caller asked for it), while under "auto" it is only reported.
  // `make_events` gives each transport the events object it reports to.
  Status start(
      const std::string& selection, const TransportContext& base,
      const std::function<std::unique_ptr<TransportEvents>(std::string_view)>& make_events);
  void shutdown(const Status& reason);
  // engine.gpu_same_host_path: which same-host transports may carry GPU
  // memory (set before any call).
  void set_gpu_path(GpuSameHostPath path) { gpu_path_ = path; }
  GpuSameHostPath gpu_path() const { return gpu_path_; }

  const std::vector<Running>& running() const { return running_; }
  std::vector<TransportInfo> describe() const;
  // The lowest-ranked running transport that is not same-host only and can
  // connect by "host:port" (tcp; not fabric, whose address is only in the
  // metadata). Null when none runs.
  Transport* network() const;
  Transport* find(std::string_view name) const;

  // The transport for one call to `peer` moving `route`, or NotSupported
  // naming what is connected and why nothing can carry it. `host_pairs`: some
  // iov of a GPU route has host memory on both sides (a transport with
  // TransportCaps::gpu_to_peer_host cannot carry that one). `peer_gpu`: some
  // iov has GPU memory on the peer's side (a transport with
  // TransportCaps::local_gpu_only cannot carry that call).
  Result<Transport*> choose(PeerId peer, MemoryRoute route, bool host_pairs = false,
                            bool peer_gpu = false) const;
  bool connected(PeerId peer) const;

  // Why `transport` is not connected to `peer` (a failed connect, another
  // host, not offered); kept for peer_transports() and logged by the caller.
  void note_unused(PeerId peer, std::string_view transport, std::string reason);
  void clear_unused(PeerId peer, std::string_view transport);
  // Drops what is kept about a peer that went away (its reasons above).
  void forget(PeerId peer);
  std::vector<PeerTransportInfo> describe_peer(PeerId peer) const;
  // When GPU memory to `peer` goes through shm's staging areas: why not
  // cuda_ipc ("cuda_ipc is not connected: ...", "engine.gpu_same_host_path=
  // shm_staged"); empty when no GPU route goes over shm. `forced`: the
  // option chose it (not a fallback).
  std::string gpu_staging_reason(PeerId peer, bool* forced = nullptr) const;

 private:
  const Running* pick(PeerId peer, MemoryRoute route, bool host_pairs = false,
                      bool peer_gpu = false) const;
  // t's capabilities towards `peer` (TransportCaps::varies_by_peer).
  static TransportCaps caps_for(const Running& t, PeerId peer);

  std::vector<Running> running_;  // by rank; fixed after start()
  std::vector<TransportInfo> unavailable_;
  GpuSameHostPath gpu_path_ = GpuSameHostPath::kAuto;
  mutable std::mutex mu_;
  std::map<PeerId, std::map<std::string, std::string, std::less<>>> unused_;  // under mu_
};

}  // namespace ferry
