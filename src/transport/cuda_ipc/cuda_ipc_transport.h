// The cuda_ipc transport: GPU memory of another process on this host, copied
// by the initiator over NVLink / PCIe peer-to-peer (or within one GPU).
//
// Initiator-driven, with grants. Before its first operation on a peer's
// region the initiator sends GRANT_REQ naming the descriptor (region id,
// advertised range, key, access). The target checks it exactly as tcp checks
// an operation -- RegionRegistry::check_remote on the whole advertised range
// with the claimed access -- and answers with IPC handles of the allocations
// that cover the region (legacy cudaIpc handle, or cuMem POSIX descriptors
// passed with SCM_RIGHTS). The initiator maps them once (cached per
// connection by the allocation's buffer id, shared by every region of it)
// and from then on copies with its own CopyStream, confined by its engine to
// the granted range and access. No message is exchanged per write; a write's
// notification is sent after the copy completed.
//
// The target holds a RegionPin for every region it granted, so deregistration
// waits until every importer let go: release_revoked_regions() sends REVOKE,
// the importer drops the grant, waits for its copies into the region, unmaps
// and answers REVOKE_ACK, and only then is the pin dropped. An importer that
// does not answer within cuda_ipc.revoke_timeout_ms loses its connection.
// docs/design.md ("cuda_ipc: grants and revocation") has the full argument.
//
// Local GPU memory with peer *host* memory is target-driven instead (the
// initiator cannot map the peer's host memory): the initiator exports its own
// GPU allocation once per connection (PUSH_EXPORT), then sends COPY_REQs; the
// target maps the export, checks every segment with check_remote (one bad
// segment: nothing moves), copies with its own CopyStream between the mapped
// GPU memory and its host region, and answers COPY_RESP once the copy is done.
//
// Threads: one epoll I/O thread reads every control socket and answers
// grants and revocations; one completion thread polls the copy streams while
// copies are in flight (and sleeps when none are), completes transfers,
// sends notifications and REVOKE_ACKs, and enforces revoke deadlines.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "ferry/gpu.h"
#include "transport/cuda_ipc/cuda_ipc_wire.h"
#include "transport/cuda_ipc/ipc_memory.h"
#include "transport/transport.h"

namespace ferry::cuda_ipc {

extern const OptionSpec kCudaIpcOptionSpecs[];
extern const size_t kCudaIpcOptionSpecCount;

struct CudaIpcOptions {
  std::string socket_dir = "/tmp";
  std::chrono::milliseconds connect_timeout{5000};
  std::chrono::milliseconds grant_timeout{10000};
  std::chrono::milliseconds revoke_timeout{2000};
  std::chrono::milliseconds send_timeout{10000};
  uint32_t sm_budget = 8;
  uint64_t kernel_max_block = 256 << 10;
  uint64_t peer_kernel_max_block = 256 << 10;
  bool batch_api = true;
  uint64_t resident_max_block = 64 << 10;  // between two GPUs
  uint64_t same_gpu_resident_max_block = 128 << 10;
  uint32_t resident_linger_us = 200;
  std::chrono::microseconds poll_linger{50};
  uint32_t engine_max_blocks = 1;
  bool waiter_polls = true;
  bool after_default_stream = true;
  bool fault_refuse_import = false;  // testing: every import fails as a driver refusal would
};

// The descriptor a grant was made for: ops may use exactly this range/access.
using GrantKey = std::tuple<RegionId, uint64_t, uint64_t, uint64_t, uint8_t>;

// A peer's region mapped here.
struct ImportedGrant {
  GrantKey key;
  std::shared_ptr<Mapping> mapping;
  uint8_t* address = nullptr;  // the advertised start, in this process
  uint64_t length = 0;         // advertised length
  uint32_t in_flight = 0;      // copy groups using it (under Connection::mu)
};

struct Connection : std::enable_shared_from_this<Connection> {
  ~Connection();

  int fd = -1;
  pid_t pid = 0;    // the peer's, from SO_PEERCRED
  PeerId peer = 0;  // known once the handshake is done
  bool outgoing = false;
  bool established = false;  // I/O thread / set-up only
  std::string via;
  std::string gpu_note;  // outgoing: the peer's GPUs this process does not see
  std::atomic<bool> dead{false};

  // Frames go out whole, one at a time. Also guards `exported` (a grant is
  // recorded and sent under it, so a REVOKE can never overtake its GRANT).
  std::mutex send_mu;
  struct Exported {
    RegionPin pin;
    bool revoke_sent = false;
    std::chrono::steady_clock::time_point revoke_deadline{};
  };
  std::unordered_map<RegionId, Exported> exported;

  // Importer state. grant_mu serialises asking for and mapping grants, so
  // two threads never map one allocation twice.
  std::mutex grant_mu;
  std::mutex mu;
  std::condition_variable cv;  // a grant answer arrived, or the connection died
  std::string dead_reason;     // under mu
  // Why the driver would not map the peer's memory here (under mu); once
  // set, this peer's GPU memory goes by the next transport.
  std::string driver_refused;
  std::map<GrantKey, std::shared_ptr<ImportedGrant>> grants;
  std::unordered_map<uint64_t, std::weak_ptr<Mapping>> mappings;  // peer buffer id →
  struct GrantAnswer {
    bool done = false;
    Grant grant;
    std::vector<int> fds;
  };
  std::unordered_map<uint64_t, GrantAnswer> grant_waits;  // request id →

  // --- local GPU with peer host memory, initiator side ---
  // push_mu serialises resolving exports and sending COPY_REQs, so no
  // COPY_REQ can name an export that a later PUSH_EXPORT replaced.
  std::mutex push_mu;
  struct LocalExport {
    uint64_t id = 0;
    uint64_t buffer_id = 0;  // of the allocation at check_address when exported
    uint64_t check_address = 0;
    uint64_t span_base = 0;
    uint64_t span_length = 0;
  };
  std::vector<LocalExport> local_exports;  // under push_mu
  uint64_t next_export_id = 1;             // under push_mu
  // COPY_REQs not yet answered (under mu): request id → transfer.
  std::unordered_map<uint64_t, std::shared_ptr<Transfer>> push_waits;

  // --- target side: the initiator's exports mapped here (I/O thread only) ---
  struct PeerExport {
    std::shared_ptr<Mapping> mapping;  // null when mapping failed: `error` says why
    Status error;
    uint64_t span_base = 0;
    uint64_t span_length = 0;
  };
  std::unordered_map<uint64_t, PeerExport> peer_exports;  // export id →

  // --- I/O thread only ---
  Bytes rx;
  size_t rx_len = 0;
  std::deque<int> rx_fds;    // received, not yet taken by a GRANT
  size_t announced_fds = 0;  // of rx_fds, announced by FDS frames
};

class CudaIpcTransport final : public Transport {
 public:
  CudaIpcTransport() = default;
  ~CudaIpcTransport() override;

  std::string_view name() const override { return "cuda_ipc"; }
  TransportCaps capabilities() const override;
  TransportCaps capabilities_for(PeerId peer) const override;
  std::string peer_limits(PeerId peer) const override;
  Status start(const TransportContext& context) override;
  void shutdown(const Status& reason) override;
  Bytes local_address() const override;
  std::string local_address_text() const override;
  Result<PeerId> connect(ByteView peer_address, PeerId expected_peer) override;
  bool is_connected(PeerId peer) const override;
  std::string peer_address(PeerId peer) const override;
  Status post_write(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                    std::vector<Segment> segments) override;
  Status post_read(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                   std::vector<Segment> segments) override;
  Status post_notification(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                           Bytes payload) override;
  void cancel(Transfer& transfer) override;
  void release_revoked_regions() override;
  void progress(const Transfer& transfer) override;
  // A poll is one cudaEventQuery per busy stream: a finished copy is seen
  // within ~0.3 us of spinning instead of ~2.5 us.
  uint32_t progress_spins() const override { return 8; }
  // A caller polling test() (UCCL's poll_async, NIXL's check_xfer_state)
  // reaps the copy streams itself, as a spinning wait() does; the lease it
  // takes lapses on its own 20 us after its last poll.
  void test_progress(const Transfer& transfer) override { progress(transfer); }
  // The GPU copies; a 16 MiB write over NVLink ends in ~50 us, well within a
  // spin, and a sleeping waiter pays ~6 us of wake-up on every size.
  uint64_t wait_spin_max_bytes() const override { return UINT64_MAX; }

 private:
  // One copy stream per (device, kind): the default one (SM kernel for small
  // blocks, copy engine for large ones) and a copy-engine-only one for
  // pageable host memory, which the kernel cannot read.
  // A COPY_REQ this engine serves as the target: answered when all its copy
  // groups finished. Holds the regions' pins and the export mappings.
  struct Served {
    std::shared_ptr<Connection> conn;
    uint64_t request_id = 0;
    std::vector<RegionPin> pins;
    std::vector<std::shared_ptr<Mapping>> mappings;
    std::atomic<uint32_t> outstanding{0};
    std::mutex mu;
    Status error;  // under mu
    bool has_notification = false;
    Bytes notification;
  };
  struct InFlight {
    std::shared_ptr<Transfer> transfer;  // null for a served COPY_REQ
    std::shared_ptr<Connection> conn;
    uint64_t ticket = 0;
    std::vector<std::shared_ptr<ImportedGrant>> grants;
    std::shared_ptr<Served> served;
  };
  struct StreamSlot {
    int device = 0;
    bool engine_only = false;
    bool peer = false;  // local GPU to another GPU's memory (peer_kernel_max_block)
    std::unique_ptr<CopyStream> stream;
    std::mutex mu;  // submit + push in ticket order
    std::deque<InFlight> fifo;
  };
  struct PendingRevoke {
    std::shared_ptr<Connection> conn;
    std::vector<uint64_t> region_ids;
    std::vector<std::shared_ptr<ImportedGrant>> grants;
  };

  Status read_options();
  Status establish(const std::shared_ptr<Connection>& c);
  void watch(const std::shared_ptr<Connection>& c);

  // --- I/O thread ---
  void io_loop();
  void on_accept();
  void on_readable(const std::shared_ptr<Connection>& c);
  Status parse_frames(const std::shared_ptr<Connection>& c);
  Status on_frame(const std::shared_ptr<Connection>& c, const FrameHeader& h, ByteView body);
  Status on_hello(const std::shared_ptr<Connection>& c, const FrameHeader& h, ByteView body);
  Status serve_grant(Connection& c, const GrantRequest& q);
  Status on_grant(Connection& c, ByteView body);
  Status on_revoke(const std::shared_ptr<Connection>& c, ByteView body);
  Status on_revoke_ack(Connection& c, ByteView body);
  Status on_push_export(Connection& c, ByteView body);
  Status serve_copy(const std::shared_ptr<Connection>& c, CopyRequest& q);
  Status on_copy_response(Connection& c, ByteView body);

  // --- initiator ---
  Result<std::shared_ptr<Connection>> live_connection(PeerId peer) const;
  std::string driver_refusal(PeerId peer) const;  // empty: none
  Status post(PeerId peer, const std::shared_ptr<Transfer>& t, std::vector<Segment>& segments,
              bool write);
  // The mapped-grant path for `segments` (peer GPU memory); `extra` more
  // units of the transfer are counted outstanding (COPY_REQs sent after).
  Status post_granted(const std::shared_ptr<Connection>& c, const std::shared_ptr<Transfer>& t,
                      const std::vector<Segment>& segments, bool write, uint64_t extra);
  // The target-driven path (local GPU, peer host memory): COPY_REQs built
  // here, sent by send_copy_requests.
  Status build_copy_requests(Connection& c, const std::vector<Segment>& segments, bool write,
                             std::vector<CopyRequest>* out);
  void send_copy_requests(Connection& c, const std::shared_ptr<Transfer>& t,
                          std::vector<CopyRequest>& requests);
  // The grant for each segment (requested and mapped where missing), each
  // counted in flight once per use.
  Status acquire_grants(const std::shared_ptr<Connection>& c, const std::vector<Segment>& segments,
                        std::vector<ImportedGrant*>* per_segment,
                        std::vector<std::shared_ptr<ImportedGrant>>* used);
  // `access_device`: the local GPU that copies to or from the grant's memory
  // (-1: local host memory), see Mapping::import.
  Result<std::shared_ptr<ImportedGrant>> request_grant(const std::shared_ptr<Connection>& c,
                                                       const GrantKey& key, int access_device);
  void release_grants(Connection& c, const std::vector<std::shared_ptr<ImportedGrant>>& grants);
  Result<StreamSlot*> slot_for(int device, bool engine_only, bool peer);

  // --- completion thread (and waiters, through progress()) ---
  void completion_loop();
  // Completes what the copy streams finished (under reap_mu_); true if
  // anything did. `check_failures`: also ask whether a stream failed.
  bool reap(bool check_failures);
  void finish_group(InFlight& f, const Status& status);
  void finish_transfer(Connection& c, const std::shared_ptr<Transfer>& t);
  void finish_served(Served& s);
  bool process_revokes();
  void enforce_revoke_deadlines();
  void wake_completion();

  // --- both ---
  Status send_frame(Connection& c, const Bytes& frame, std::span<const int> fds = {});
  void fail_connection(Connection& c, const Status& reason);
  std::string describe(const Connection& c) const;

  TransportContext ctx_;
  CudaIpcOptions opt_;
  Address address_;
  std::string socket_path_;
  int listen_fd_ = -1;
  int epfd_ = -1;
  int wakefd_ = -1;
  std::thread io_thread_;
  std::atomic<bool> io_stop_{false};

  std::mutex io_mu_;
  std::unordered_map<Connection*, std::shared_ptr<Connection>> watched_;

  mutable std::mutex mu_;
  std::atomic<int> refused_peers_{0};  // connections with driver_refused set
  bool started_ = false;
  bool stopped_ = false;
  std::unordered_map<PeerId, std::shared_ptr<Connection>> primary_;
  std::vector<std::shared_ptr<Connection>> open_;
  std::mutex connect_mu_;
  std::atomic<uint64_t> next_request_id_{1};

  std::mutex slots_mu_;
  std::vector<std::unique_ptr<StreamSlot>> slots_;  // never shrinks while running

  std::thread completion_thread_;
  std::mutex completion_mu_;
  std::condition_variable completion_cv_;
  bool completion_stop_ = false;              // under completion_mu_
  std::atomic<uint64_t> in_flight_{0};        // copy groups not yet finished
  std::vector<PendingRevoke> revokes_;        // under completion_mu_
  std::mutex reap_mu_;                        // one reaper at a time
  std::atomic<int64_t> last_waiter_poll_{0};  // steady_clock ticks of the last progress()
  std::shared_ptr<TraceLog> trace_log_;       // cuda_ipc.trace: where traced transfers go
};

}  // namespace ferry::cuda_ipc
