// The transport interface (DESIGN.md §2): the narrow contract between core and
// each way of moving bytes (tcp now; shm, cuda_ipc, fabric later).
//
// Core validates every request locally (local region, descriptor range,
// access) and hands the transport a list of Segments. The transport moves the
// bytes, has the target re-validate each segment against its registry, and
// completes the Transfer exactly once (Transfer::complete; later calls are
// ignored). Transports own their I/O threads; they never call user code.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/options.h"
#include "core/region_registry.h"
#include "core/transfer.h"
#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry {

// One contiguous piece of a transfer, already checked by the initiator.
struct Segment {
  uint8_t* local = nullptr;
  uint64_t length = 0;
  RemoteAccessRequest remote;  // re-checked by the target
  int local_device = -1;       // >= 0: local side is GPU memory on that device
  int remote_device = -1;      // >= 0: remote side is GPU memory (from the descriptor)
};

// What the transport tells core about (called from transport threads).
class TransportEvents {
 public:
  virtual ~TransportEvents() = default;
  virtual void on_notification(PeerId peer, Bytes payload) = 0;
  virtual void on_peer_up(PeerId peer) = 0;
  virtual void on_peer_down(PeerId peer, const Status& reason) = 0;
};

struct TransportContext {
  uint64_t engine_id = 0;
  std::string listen;  // "host:port" from EngineConfig
  RegionRegistry* registry = nullptr;
  TransportEvents* events = nullptr;
  const OptionSet* options = nullptr;
  // For a handshake that carries engine metadata (tcp's, so that connect by
  // address reaches every transport). Either may be empty (tests, tools).
  // The engine's metadata; empty while the engine is still starting.
  std::function<Bytes()> local_metadata;
  // A peer that says it is engine `peer` sent this metadata: the engine
  // checks it as it checks metadata passed to connect() (and that it names
  // `peer`) and keeps it; non-Ok refuses the connection with that reason.
  // Any thread; takes no transport's locks.
  std::function<Status(PeerId peer, ByteView metadata)> peer_metadata;
};

struct TransportCaps {
  bool host_memory = true;
  bool cuda_memory = false;
  // With cuda_memory: only calls whose every remote side is GPU memory (the
  // transport maps the peer's GPU memory; it cannot reach the peer's host
  // memory).
  bool cuda_peer_only = false;
  // With cuda_peer_only: also carries local GPU memory with peer host memory,
  // provided every iov whose remote side is host memory has GPU memory on the
  // local side (the target copies between the two; cuda_ipc).
  bool gpu_to_peer_host = false;
  // With cuda_memory: GPU memory on the local side only -- every remote side
  // must be host memory (fabric where the peer does not register GPU memory
  // with FI_HMEM: local GPU memory is staged through pinned host memory, the
  // peer's GPU memory is out of one-sided reach).
  bool local_gpu_only = false;
  // What the transport carries depends on the peer: core asks
  // capabilities_for(peer) for each call with GPU memory instead of using
  // these (host_memory must not vary: host-only calls use capabilities()).
  bool varies_by_peer = false;
  bool same_host_only = false;
  // connect() takes only the address blob from the peer's metadata (fabric),
  // never "host:port": Engine::connect(host_port) leaves such a transport out.
  bool metadata_only = false;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string_view name() const = 0;
  virtual TransportCaps capabilities() const = 0;
  // What it carries to one peer, with TransportCaps::varies_by_peer (called
  // per call: keep it cheap). Default: capabilities().
  virtual TransportCaps capabilities_for(PeerId /*peer*/) const { return capabilities(); }
  // For peer_transports(): what it cannot carry to `peer` and why (empty:
  // nothing to add to what its capabilities say).
  virtual std::string peer_limits(PeerId /*peer*/) const { return {}; }

  // NotSupported when the transport cannot work on this machine (the message
  // says why); the engine then runs without it and reports the reason.
  virtual Status start(const TransportContext& context) = 0;
  // Stops I/O threads; every transfer still in flight completes with `reason`.
  virtual void shutdown(const Status& reason) = 0;

  // Address bytes for our metadata; the peer passes them to connect().
  virtual Bytes local_address() const = 0;
  // Human-readable form of local_address(), for logs and tools.
  virtual std::string local_address_text() const = 0;
  // Running totals for Engine::transports() (name, value): what the
  // transport's mechanisms did, for operators and tests. Read rarely.
  virtual std::vector<std::pair<std::string, uint64_t>> counters() const { return {}; }
  // Connects (blocking, bounded by the transport's connect timeout) and
  // returns the remote engine id. `expected_peer` 0 accepts any engine.
  virtual Result<PeerId> connect(ByteView peer_address, PeerId expected_peer) = 0;
  virtual bool is_connected(PeerId peer) const = 0;
  // The peer's address on its side of the connection, for messages and
  // callers; empty when not connected.
  virtual std::string peer_address(PeerId peer) const = 0;

  // Data movement. The transfer's `outstanding` and completion are the
  // transport's to manage from here on.
  virtual Status post_write(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                            std::vector<Segment> segments) = 0;
  virtual Status post_read(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                           std::vector<Segment> segments) = 0;
  virtual Status post_notification(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                   Bytes payload) = 0;
  // After this returns no more bytes of `transfer` move into local memory and
  // none of its frames is still reading local memory.
  virtual void cancel(Transfer& transfer) = 0;
  // Regions were revoked (Region::revoked) while operations still hold them:
  // let go soon, without waiting for peers -- bytes still to arrive for a
  // revoked region are discarded (the write fails with NotFound), bytes still
  // to be sent from one are copied out first. Any thread; returns at once.
  virtual void release_revoked_regions() {}
  // Called, often, by a thread spinning in wait() on `transfer`: a transport
  // that learns of completions by polling (a CUDA event, a completion queue)
  // may poll here, on the waiting thread, instead of handing the news over
  // from its own thread. Returns at once when there is nothing to do.
  virtual void progress(const Transfer& /*transfer*/) {}
  // How many pause instructions a spinning waiter runs between two calls of
  // progress() (~40 ns each on x86): a transport whose poll is one cheap
  // query asks for fewer, so that a finished copy is seen sooner.
  virtual uint32_t progress_spins() const { return 64; }
  // wait() spins (engine.wait_spin_us) only on transfers of at most this many
  // bytes: a large host-memory copy outlasts a wake-up and spinning would take
  // a core from the threads doing it. A transport whose copies run elsewhere
  // (a GPU's copy engine) finishes large transfers in microseconds and may say
  // more.
  virtual uint64_t wait_spin_max_bytes() const { return 256 << 10; }
  // The thread that called progress() stops: it goes to sleep on `transfer`
  // (finished false) or returns with it finished. A transport that kept its
  // own thread off the work while a waiter polled hands it back here.
  virtual void stop_polling(const Transfer& /*transfer*/, bool /*finished*/) {}
  // Called by Engine::test on a small transfer not finished yet: a transport
  // whose completions the caller's thread can read cheaply does so here. Unlike
  // progress() it promises no further polls (no lease, no stop_polling()).
  virtual void test_progress(const Transfer& /*transfer*/) {}
};

// Self-registration: each transport folder has a small *_plugin.cc that adds
// itself here; core looks transports up by name (no #ifdef chains).
struct TransportRegistration {
  std::string name;
  // Preference when several connected transports can carry a transfer: lower
  // wins (same-host transports before network ones, fabric before tcp).
  int rank = 100;
  std::unique_ptr<Transport> (*create)();
  std::span<const OptionSpec> options;
};
bool register_transport(TransportRegistration registration);
const std::vector<TransportRegistration>& registered_transports();
const TransportRegistration* find_transport(std::string_view name);

}  // namespace ferry
