// The Ferry engine: register memory, advertise it, connect to peers and move
// bytes with one-sided WRITE/READ plus notifications.
//
// Thread safety: every method may be called from any thread concurrently.
// Callbacks: none; completion is observed with test()/wait().
// Re-entrancy: methods never call back into user code.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry {

struct EngineConfig {
  // Address the default transport (tcp) listens on. Port 0 picks a free port.
  // A wildcard host ("0.0.0.0") advertises every interface address in metadata.
  std::string listen = "127.0.0.1:0";
  // Component options by "component.name", e.g. {"tcp.streams", "4"}. Each can
  // also be set by the environment as FERRY_<COMPONENT>_<NAME>; a value given
  // here wins over the environment. Unknown names and invalid values are errors.
  std::map<std::string, std::string> options;
  // A metadata directory ("etcd://host:port/prefix", docs/directory.md) and
  // this engine's name in it. With both set, create() publishes the engine's
  // metadata under `name` (refused when a live engine holds it), connect(name)
  // finds peers by name, and publish()/lookup() exchange descriptors by key.
  // Everything published vanishes when the engine is destroyed or its process
  // dies (a lease). Empty: no directory.
  std::string directory;
  std::string name;
};

// One line of `ferry-info --config`: an option with its effective value.
struct OptionInfo {
  std::string name;    // "tcp.streams"
  std::string type;    // "uint", "bytes", "bool", "string", "duration_ms"
  std::string value;   // effective value
  std::string source;  // "default", "environment FERRY_TCP_STREAMS", "config"
  std::string doc;
};

// A transport this engine runs, or one it could not start (Engine::transports()).
struct TransportInfo {
  std::string name;  // "tcp", "shm"
  bool running = false;
  bool same_host_only = false;
  std::string detail;  // its address when running, else why it is not
  // What it did since the engine started, by name (docs/user-guide.md,
  // "Counters"): e.g. fabric's combined_calls. Empty when not running.
  std::vector<std::pair<std::string, uint64_t>> counters;
};

// How this engine reaches one peer over one transport (Engine::peer_transports()).
struct PeerTransportInfo {
  std::string transport;
  bool connected = false;
  // What this transport carries to the peer, a comma list of routes: "host
  // memory", "peer GPU memory", "local GPU with peer host memory"; "" when
  // other transports carry all of them.
  std::string carries;
  // Why it carries nothing, or less than it could (not connected: the failed
  // connect's message; another host; a transport preferred to it).
  std::string reason;
  // Connected: how it reaches the peer, as the transport says -- its address
  // and, where a transport has several ways, which one and why (shm: "...,
  // shared memory (CMA refused: ...)").
  std::string via;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(const EngineConfig& config = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Random 64-bit id of this engine; peers know us by it.
  uint64_t id() const;
  // Bytes that let a peer connect to us (engine id, version, addresses).
  Bytes metadata() const;
  // "ip:port" the tcp transport actually listens on.
  std::string listen_address() const;
  // Every option with its effective value and where it came from.
  std::vector<OptionInfo> options() const;
  // The transports this engine runs (in preference order) and those it could
  // not start, with the reason.
  std::vector<TransportInfo> transports() const;

  // --- peers ---------------------------------------------------------------
  // Connect by metadata bytes. Cached: the same peer again returns the same id.
  // Connects every transport both engines run that can work between them: the
  // same-host ones (shm) when both metadata carry the same host id, and the
  // network one (tcp). Which one carries what, and why a faster one was not
  // taken, is logged and reported by peer_transports().
  Result<PeerId> connect(ByteView metadata);
  // Connect by "host:port" (IPv4, [IPv6] or a host name): the network
  // transport only, since the peer's host identity is unknown without its
  // metadata. With a directory (EngineConfig::directory), a string without ':'
  // is an engine name instead: its metadata is looked up there (waiting up to
  // `wait` for it to appear) and every usable transport connects, as with
  // connect(metadata).
  Result<PeerId> connect(std::string_view host_port_or_name,
                         std::chrono::milliseconds wait = std::chrono::milliseconds(0));
  // Peers that connected to us or that we connected to, alive now.
  std::vector<PeerId> peers() const;
  // The network address ("ip:port") of a connected peer's side of the
  // connection; NotFound when the peer is not connected.
  Result<std::string> peer_address(PeerId peer) const;
  // One entry per transport this engine runs: connected to the peer or not,
  // what it carries there and why. NotFound when the peer is unknown.
  Result<std::vector<PeerTransportInfo>> peer_transports(PeerId peer) const;

  // --- memory --------------------------------------------------------------
  Result<MemoryRegion> register_memory(void* address, uint64_t length);
  // Revokes at once: remote operations already started on the region finish
  // before this returns; later ones are refused with NotFound.
  Status deregister_memory(RegionId region);
  // A descriptor granting `access` to [offset, offset+length) of `region`.
  // length == UINT64_MAX means "to the end of the region".
  Result<RemoteDescriptor> advertise(RegionId region, uint64_t offset = 0,
                                     uint64_t length = UINT64_MAX,
                                     uint8_t access = kAccessReadWrite) const;

  // --- one-sided transfers ------------------------------------------------
  // local[i] and remote[i] pair up and must have equal lengths. 1 … 1,000,000
  // entries. A write may carry a notification, delivered to the target only
  // after every byte of the write is placed.
  Result<TransferId> write_async(PeerId peer, std::span<const LocalIov> local,
                                 std::span<const RemoteIov> remote,
                                 std::optional<ByteView> notification = std::nullopt);
  Result<TransferId> read_async(PeerId peer, std::span<const LocalIov> local,
                                std::span<const RemoteIov> remote);
  Status write(PeerId peer, std::span<const LocalIov> local, std::span<const RemoteIov> remote,
               std::optional<ByteView> notification = std::nullopt,
               std::chrono::milliseconds timeout = std::chrono::hours(24));
  Status read(PeerId peer, std::span<const LocalIov> local, std::span<const RemoteIov> remote,
              std::chrono::milliseconds timeout = std::chrono::hours(24));

  // InProgress while running; the final status once (then the id is released,
  // and later calls answer NotFound naming the id).
  Status test(TransferId transfer);
  // Waits up to `timeout`; Timeout leaves the transfer running and the id valid.
  Status wait(TransferId transfer, std::chrono::milliseconds timeout);
  // Stops the transfer: after this returns no more bytes move into local
  // memory for it; its final status is Cancelled (unless it already finished).
  Status cancel(TransferId transfer);

  // --- directory (EngineConfig::directory) ----------------------------------
  // This engine's name in the directory ("" without one).
  const std::string& name() const;
  // Publishes `descriptor` under (this engine's name, key).
  Status publish(std::string_view key, const RemoteDescriptor& descriptor);
  // The descriptor engine `name` published under `key`, waiting up to `wait`.
  Result<RemoteDescriptor> lookup(std::string_view name, std::string_view key,
                                  std::chrono::milliseconds wait = std::chrono::milliseconds(0));

  // --- notifications -------------------------------------------------------
  Status notify(PeerId peer, ByteView payload);
  // Takes every notification received so far (oldest first).
  std::vector<Notification> take_notifications();
  // Blocks until at least one notification is there or the timeout passes.
  std::vector<Notification> wait_notifications(std::chrono::milliseconds timeout);
  // Notifications dropped because those not yet taken already held
  // engine.notification_queue_bytes (256 MiB by default); 0 while the
  // application takes them.
  uint64_t dropped_notifications() const;

  class Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Library version, e.g. "0.1.0", and the wire protocol version.
std::string_view version();
uint16_t protocol_version();

}  // namespace ferry
