// The fabric transport: libfabric reliable-datagram endpoints (FI_EP_RDM)
// with one-sided RMA, for RDMA-class fabrics (cxi, efa, verbs;ofi_rxm) and,
// for testing here, tcp;ofi_rxm. libfabric is opened with dlopen
// (fabric.library); without it, or without a provider offering
// FI_EP_RDM + FI_RMA + FI_MSG, start() answers NotSupported and the engine
// runs on its other transports.
//
// One endpoint, one completion queue and one address vector per engine.
// Control messages (handshake, grants, revocations, notifications,
// keepalives) are untagged sends on the same endpoint (fabric_wire.h).
//
// Keys without touching the descriptor: before its first operation on a
// peer's descriptor the initiator sends GRANT_REQ (region, advertised range,
// key, access); the target runs RegionRegistry::check_remote over the whole
// advertised range with the claimed access, registers the region with the
// provider once per (region, access) -- a read-only descriptor gets a key
// that only allows remote reads -- and answers with the provider key and
// the base of the address form the provider wants (virtual address under
// FI_MR_VIRT_ADDR, offsets otherwise). The target holds a RegionPin per
// registered region; deregistration revokes the region,
// release_revoked_regions() closes its provider registrations at once, drops
// the pin and tells the importers (REVOKE), which drop the key: later
// operations ask again and are refused with NotFound.
//
// One progress thread per engine reads the CQ (manual progress: reading is
// what moves the bytes for software providers) and sleeps on the CQ's wait
// fd when nothing happens. Operations go out in a bounded window
// (fabric.max_inflight operations, fabric.max_inflight_bytes bytes);
// batches larger than the window queue and are posted as completions free
// room, without per-iov allocation. A peer that has not been heard from for
// fabric.peer_timeout_ms (keepalive PING/PONG) is declared dead and every
// transfer to it fails with PeerDisconnected -- once the provider has given
// back every operation of it already posted: until then the provider may
// still write the transfer's buffers (a peer stopped, not dead, resumes).
//
// GPU memory (docs/fabric.md, "GPU memory"): where the provider offers FI_HMEM
// (fabric.hmem), GPU regions are registered with fi_mr_regattr
// (FI_HMEM_CUDA) and carried directly, on either side. Without it, local GPU
// memory goes through the pinned staging slots shared with tcp
// (transport/common/gpu_staging.h): a write copies device → slot, then
// fi_write from the slot; a read fi_reads into a slot, then copies slot →
// device; slots are pipelined against the network, bounded by the pool, and
// the pool is registered with the provider once. The peer's GPU memory needs
// FI_HMEM on the peer (its address and HELLO say so): without it
// capabilities_for(peer) leaves such calls to another transport (tcp).
// docs/fabric.md has the rest.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_rma.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "transport/common/gpu_staging.h"
#include "transport/fabric/fabric_wire.h"
#include "transport/transport.h"

namespace ferry::fabric {

extern const OptionSpec kFabricOptionSpecs[];
extern const size_t kFabricOptionSpecCount;

// The few exported symbols of libfabric; everything else is an inline call
// through the objects' operation tables.
struct Api {
  void* handle = nullptr;
  int (*getinfo)(uint32_t, const char*, const char*, uint64_t, const struct fi_info*,
                 struct fi_info**) = nullptr;
  void (*freeinfo)(struct fi_info*) = nullptr;
  struct fi_info* (*dupinfo)(const struct fi_info*) = nullptr;
  int (*fabric)(struct fi_fabric_attr*, struct fid_fabric**, void*) = nullptr;
  const char* (*strerror)(int) = nullptr;
  uint32_t (*version)() = nullptr;
};

struct FabricOptions {
  std::string library = "libfabric.so.1";
  std::string provider;
  std::string domain;
  uint32_t max_inflight = 256;
  uint64_t max_inflight_bytes = 64ull << 20;
  uint32_t peer_window_percent = 75;
  std::chrono::milliseconds connect_timeout{5000};
  std::chrono::milliseconds grant_timeout{10000};
  std::chrono::milliseconds peer_timeout{1500};
  std::chrono::milliseconds cancel_timeout{10000};
  std::chrono::microseconds poll_spin{50};
  uint32_t combine_after = 2;
  uint64_t combine_max_bytes = 64 << 10;
  enum class Hmem : uint8_t { kAuto, kOn, kOff } hmem = Hmem::kAuto;
  uint64_t gpu_staging_bytes = 64ull << 20;
};

// The descriptor a grant was made for.
using GrantKey = std::tuple<RegionId, uint64_t, uint64_t, uint64_t, uint8_t>;
struct RemoteKey {
  uint64_t mr_key = 0;
  uint64_t base = 0;
};

struct Job;

// The transport's address vector, shared with the peers whose entries it
// holds: a peer's entry is removed when the last reference to the peer goes
// (no op can still name it then: ops hold their peer), which may be after the
// transport closed the vector (a thread's lookup cache holds a peer). Each
// insert is matched by one remove: inserting an address already present
// gives its index again and counts a use (libfabric's util AV, which
// tcp;ofi_rxm uses; checked with two inserts and one remove), so removing a
// duplicate leaves the other user's entry in place.
class AvTable {
 public:
  explicit AvTable(struct fid_av* av) : av_(av) {}
  // One entry for a peer's raw address; FI_ADDR_UNSPEC with `*error` set
  // where the provider rejects it.
  fi_addr_t insert(const void* name, int* error);
  void remove(fi_addr_t addr);
  // The vector is being closed: later removals do nothing.
  void close();
  uint64_t live() const;  // entries inserted and not removed

 private:
  mutable std::mutex mu_;
  struct fid_av* av_;
  uint64_t live_ = 0;
};

struct Peer {
  ~Peer();  // removes `addr` from `av`
  PeerId id = 0;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  std::shared_ptr<AvTable> av;  // the vector `addr` is an entry of
  std::string via;
  std::atomic<bool> dead{false};
  std::atomic<int64_t> last_heard{0};  // steady_clock nanoseconds
  // The peer registers GPU memory with FI_HMEM (its address / HELLO say so):
  // its GPU memory can be reached one-sided. Set before the peer is listed.
  bool hmem = false;

  // RMA ops to the peer posted and not completed; under the transport's
  // post_mu_ (small operations wait to be combined beyond
  // fabric.combine_after of them).
  uint32_t inflight_ops = 0;
  uint64_t inflight_bytes = 0;  // their payload; under post_mu_
  uint64_t completed_ops = 0;   // RMA ops to the peer completed; under post_mu_

  std::mutex mu;
  std::condition_variable cv;
  std::string dead_reason;  // under mu
  std::map<GrantKey, RemoteKey> grants;
  std::unordered_set<RegionId> revoked;  // regions the peer told us are gone
  // REVOKEs handled: raised under the transport's post_mu_, read without it
  // before a call's keys are looked up.
  std::atomic<uint64_t> revoke_gen{0};
  struct GrantWait {
    bool done = false;
    Grant grant;
  };
  std::unordered_map<uint64_t, GrantWait> grant_waits;
};

// One posted provider operation (an RMA op, a send or a receive). The
// fi_context2 is first: the completion's op_context is the Op.
//
// An RMA op moves part of one job -- or, combined, the whole of several
// small one-segment jobs to one peer's region (`parts` > 1: job is the
// first, more[] the rest, iov[k] / rma[k] the k-th job's bytes).
struct Op {
  static constexpr size_t kMaxIov = 8;
  struct fi_context2 ctx;
  enum Kind : uint8_t { kRma, kSend, kRecv } kind = kRma;
  std::shared_ptr<Job> job;
  std::shared_ptr<Peer> peer;
  Bytes buf;                    // send / receive bytes
  struct fid_mr* mr = nullptr;  // buf's registration (FI_MR_LOCAL only)
  uint64_t bytes = 0;           // RMA payload bytes
  RegionId remote_region = 0;
  int32_t group = -1;  // the staging group its local iovs lie in (-1: none)
  size_t niov = 0;
  size_t parts = 1;                        // jobs it carries (RMA)
  std::shared_ptr<Job> more[kMaxIov - 1];  // combined: jobs 2..parts
  fi_addr_t to = FI_ADDR_UNSPEC;           // a send's destination (kept for a retry)
  struct iovec iov[kMaxIov];
  void* desc[kMaxIov];
  struct fi_rma_iov rma[kMaxIov];
};

// Staged segments of a job (local GPU memory without FI_HMEM): consecutive
// pieces packed into one staging slot. A write's group is ready once the
// device → slot copy is done, a read's once it holds a slot; the slot goes
// back when every RMA op of the group completed (a read: after the slot →
// device copy).
struct StageGroup {
  std::unique_ptr<StagingSlot> slot;
  bool ready = false;
  uint64_t bytes = 0;  // payload of its pieces
  uint64_t left = 0;   // bytes whose RMA op has not completed
  size_t first = 0;    // its pieces: segments [first, last]
  size_t last = 0;
};

// A job's segments. A one-segment call (most small ones) keeps its segment
// inline and lets core's vector go at once, on the posting thread: freed
// with the job instead, in a waiter's burst of completions, it overflowed
// glibc's per-thread cache and took malloc's slow path on both ends.
class JobSegments {
 public:
  JobSegments() = default;
  JobSegments(const JobSegments&) = delete;
  JobSegments& operator=(const JobSegments&) = delete;
  // Takes v's segments (v is left empty or as it was).
  JobSegments& operator=(std::vector<Segment>&& v) {
    if (v.size() == 1) {
      one_ = v[0];
      more_.clear();
      data_ = &one_;
      size_ = 1;
    } else {
      more_ = std::move(v);
      data_ = more_.data();
      size_ = more_.size();
    }
    return *this;
  }
  size_t size() const { return size_; }
  Segment& operator[](size_t i) { return data_[i]; }
  const Segment& operator[](size_t i) const { return data_[i]; }
  const Segment* begin() const { return data_; }
  const Segment* end() const { return data_ + size_; }

 private:
  Segment one_;
  std::vector<Segment> more_;
  Segment* data_ = nullptr;
  size_t size_ = 0;
};

struct Job {
  std::shared_ptr<Transfer> transfer;
  std::shared_ptr<Peer> peer;
  bool write = true;
  JobSegments segs;
  // Per segment: key and remote address of byte 0. A one-segment call (most
  // small ones) keeps it in one_key: no allocation.
  RemoteKey one_key;
  std::vector<RemoteKey> more_keys;
  RemoteKey& key(size_t i) { return more_keys.empty() ? one_key : more_keys[i]; }
  const RemoteKey& key(size_t i) const { return more_keys.empty() ? one_key : more_keys[i]; }
  std::vector<void*> descs;  // per segment (FI_MR_LOCAL, or local GPU memory under FI_HMEM)
  // Staging (empty when no segment is staged): per segment its group (-1:
  // none) and offset in the group's slot.
  std::vector<int32_t> group_of;
  std::vector<uint64_t> slot_off;
  std::vector<StageGroup> groups;
  // A staged read: its slot -> device copies run after the work the caller
  // queued on the default stream before posting it (null: none was queued).
  std::shared_ptr<const DefaultStreamMark> after;
  uint32_t copies = 0;    // staging copies in flight (they touch local memory)
  size_t next = 0;        // next segment to post
  uint64_t next_off = 0;  // bytes of it already posted
  uint64_t posted = 0, done = 0;
  // Held for combining: posted, with whatever company there is, once its
  // peer's completed_ops reaches this (the next completion after it was
  // held; 0: never held). A stream of other calls to the peer cannot keep
  // it waiting longer.
  uint64_t hold_until = 0;
  bool stopped = false;  // no more posting (failed, cancelled, peer dead)
  bool notify_posted = false;
  bool finished = false;
  Status error;
  size_t live_index = 0;  // its place in FabricTransport::live_jobs_ until it finishes
};

class FabricTransport final : public Transport {
 public:
  FabricTransport() = default;
  ~FabricTransport() override;

  std::string_view name() const override { return "fabric"; }
  TransportCaps capabilities() const override;
  TransportCaps capabilities_for(PeerId peer) const override;
  std::string peer_limits(PeerId peer) const override;
  // FI_HMEM is in use (GPU regions registered with the provider).
  bool hmem() const { return hmem_; }
  Status start(const TransportContext& context) override;
  Status start_unmasked(const TransportContext& context);
  void shutdown(const Status& reason) override;
  Bytes local_address() const override;
  std::string local_address_text() const override;
  // rma_ops (provider RMA operations posted), combined_ops (of them, ops
  // carrying several calls), combined_calls (calls they carried), held_calls
  // (calls that waited for company when posted).
  std::vector<std::pair<std::string, uint64_t>> counters() const override;
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
  void stop_polling(const Transfer& transfer, bool finished) override;

 private:
  struct Exported {
    RegionPin pin;
    struct fid_mr* mr[2] = {nullptr, nullptr};  // [0] read-only, [1] read-write
    uint64_t key[2] = {0, 0};
    std::unordered_set<PeerId> importers;
  };
  // A revoked region whose importers may still have ops in flight: the
  // registrations are closed and the pin (deregistration waits) is dropped
  // when each has answered REVOKE_ACK (it dropped the key and none of its
  // ops on the region is in flight), died, or fabric.peer_timeout_ms passed.
  struct MrCloser {
    void operator()(struct fid_mr* mr) const { fi_close(&mr->fid); }
  };
  using OwnedMr = std::unique_ptr<struct fid_mr, MrCloser>;
  struct Revoking {
    RegionPin pin;
    // The registrations stay open until then too: an op that reaches a
    // closed key breaks the connection (tcp;ofi_rxm shuts it down, a verbs
    // QP goes to the error state), failing everything else to that peer.
    OwnedMr mr[2];
    std::unordered_set<PeerId> waiting;
    std::chrono::steady_clock::time_point deadline;
  };
  struct ConnectWait {
    bool done = false;
    PeerId peer = 0;
    Status status;
  };

  Status load_library();
  Status open_fabric();
  std::string fi_error(int ret) const;

  Status post(PeerId peer, const std::shared_ptr<Transfer>& t, std::vector<Segment>& segments,
              bool write);
  Result<std::shared_ptr<Peer>> live_peer(PeerId peer) const;
  // peers_[peer], or null. Without peers_mu_ where this thread looked the
  // same peer up last and peers_ has not changed since: one call looks its
  // peer up three times (core's route choice, then post). The reference
  // holds until this thread's next find_peer.
  const std::shared_ptr<Peer>& find_peer(PeerId peer) const;
  // peers_mu_ held, peers_ changed (`added`: the peer listed, if any):
  // every thread's cached lookup is stale.
  void peers_changed_locked(const Peer* added);
  // The key for r's descriptor: cached, or asked of the peer (GRANT_REQ).
  // `revoke_gen`: p->revoke_gen as read before the call's lookups.
  Result<RemoteKey> grant_for(const std::shared_ptr<Peer>& p, const RemoteAccessRequest& r,
                              uint64_t revoke_gen);
  Result<void*> local_desc(const Segment& s);
  // fi_mr_reg, or fi_mr_regattr with FI_HMEM_CUDA for `device` >= 0; bound
  // to the endpoint under FI_MR_ENDPOINT. Returns the provider's code.
  int register_mr(void* address, size_t length, uint64_t access, int device, struct fid_mr** mr);

  // GPU staging (local GPU memory without FI_HMEM).
  Result<staging::GpuPath*> gpu();
  // Splits local-GPU segments into pieces of at most one slot and packs
  // consecutive ones into groups.
  Status plan_staging(Job& job, staging::GpuPath* path);
  // Asks for a slot per group, in order (no lock held).
  void start_staging(const std::shared_ptr<Job>& job);
  void on_slot(const std::shared_ptr<Job>& job, size_t group, std::unique_ptr<StagingSlot> slot);
  // post_mu_ held: every byte of group `g` has completed its RMA op.
  void group_done_locked(const std::shared_ptr<Job>& job, size_t g, const Status& error);
  bool staged_waiting_locked(const Job& job) const;

  // post_mu_ held:
  Op* take_op();
  void give_op(Op* op);
  void pump_locked();
  bool post_one_locked(Job& job, const std::shared_ptr<Job>& ref);
  // fi_writemsg (delivery-complete where offered) or fi_readmsg.
  ssize_t submit_rma(const struct fi_msg_rma& msg, bool write);
  // An RMA op to `p` of `bytes` went to the provider / completed.
  void note_posted_locked(Peer& p, uint64_t bytes);
  static void note_completed(Peer& p, uint64_t bytes) {
    --p.inflight_ops;
    p.inflight_bytes -= std::min(bytes, p.inflight_bytes);
    ++p.completed_ops;
  }
  // The peer's ops hold their share of the window (fabric.peer_window_percent):
  // more go out only as some complete, so a stopped peer leaves the rest of
  // the window to the others.
  bool peer_window_full(const Peer& p) const {
    return p.inflight_ops >= peer_max_inflight_ || p.inflight_bytes >= peer_max_inflight_bytes_;
  }
  // Combining small jobs (docs/fabric.md, "Small operations combined"):
  // `job` is one segment of host memory, at most fabric.combine_max_bytes,
  // nothing of it posted yet.
  bool combinable(const Job& job) const;
  // A combinable job waits in queue_ for company while its peer has
  // fabric.combine_after RMA ops in flight, until the next completion on the
  // peer (which pumps).
  bool held_for_combining(const Job& job) const;
  // Posts parts[0..n) (combinable, one peer, one key) as one op; false when
  // the provider is full (FI_EAGAIN) or failed (the jobs are stopped).
  bool post_combined_locked(const std::shared_ptr<Job>* parts, size_t n);
  // One job's share of a completed RMA op.
  void rma_done_locked(std::shared_ptr<Job> job, RegionId region, int32_t group, uint64_t bytes,
                       const Status& error);
  void maybe_finish_locked(const std::shared_ptr<Job>& job);
  Status send_locked(const std::shared_ptr<Peer>& p, fi_addr_t addr, Bytes bytes,
                     std::shared_ptr<Job> job);
  void fail_job_locked(const std::shared_ptr<Job>& job, const Status& s);
  // A staging copy of `job` failed: nothing more of it is posted, and the
  // first error is what the transfer reports (`what` says which copy).
  void stop_staged_job_locked(Job& job, const Status& s, const std::string& what);
  // A REVOKE from p: jobs with segments on `region` not yet posted stop.
  void stop_jobs_on_revoked_locked(const std::shared_ptr<Peer>& p, RegionId region);
  Status revoked_error(const Peer& p, RegionId region) const;

  Status send(const std::shared_ptr<Peer>& p, fi_addr_t addr, MsgType type, uint64_t request,
              const Bytes& body);

  // progress thread
  void progress_loop();
  // cq_mu_ held: handles the entries another thread read and put aside, then
  // what the CQ has now; returns how many entries it handled.
  size_t drain_cq_locked(bool read_cq);
  size_t read_cq_error_locked();  // the CQ said FI_EAVAIL: one error entry
  void handle_entry(const struct fi_cq_data_entry& e);
  void on_completion(Op* op, const Status& error);
  void on_message(const uint8_t* data, size_t len);
  Status handle(const Header& h, ByteView body);
  Status serve_grant(const std::shared_ptr<Peer>& p, uint64_t request, const GrantReq& q);
  void timers();
  void fail_peer(const std::shared_ptr<Peer>& p, const Status& reason);
  void wake(bool urgent = false);
  void drain_before_close();  // shutdown(): lets posted ops finish, at most 500 ms
  Status post_recv(Op* op);

  std::string describe(const Peer& p) const;

  TransportContext ctx_;
  FabricOptions opt_;
  Api api_;
  struct fi_info* info_ = nullptr;
  struct fid_fabric* fabric_ = nullptr;
  struct fid_domain* domain_ = nullptr;
  struct fid_ep* ep_ = nullptr;
  struct fid_cq* cq_ = nullptr;
  struct fid_av* av_ = nullptr;
  int cq_fd_ = -1;
  int wake_fd_ = -1;
  Bytes ep_name_;
  Bytes address_;
  std::string address_text_;
  uint64_t mr_mode_ = 0;
  bool hmem_ = false;  // FI_HMEM granted: GPU memory registered directly
  bool delivery_complete_ = false;
  size_t iov_limit_ = 1;
  uint64_t max_op_bytes_ = 8ull << 20;
  // Remote ranges one RMA op may carry (the provider's rma_iov_limit, at
  // most Op::kMaxIov; tcp;ofi_rxm takes 4).
  size_t rma_iov_limit_ = 1;
  // Most jobs one combined RMA op carries: the provider's iov_limit and
  // rma_iov_limit (1: never combined).
  size_t combine_limit_ = 1;
  std::atomic<uint64_t> next_key_{1};
  std::atomic<uint64_t> next_request_{1};

  std::thread progress_;
  std::atomic<bool> stop_{false};
  bool started_ = false;
  bool stopped_ = false;
  std::mutex life_mu_;

  mutable std::mutex peers_mu_;
  std::unordered_map<PeerId, std::shared_ptr<Peer>> peers_;
  // Why peers were lost, for errors that name them after they left peers_
  // (fail_peer): the last kDepartedKept, oldest first out.
  static constexpr size_t kDepartedKept = 256;
  std::unordered_map<PeerId, std::string> departed_;
  std::deque<PeerId> departed_order_;
  std::shared_ptr<AvTable> av_table_;
  // Raised (under peers_mu_) whenever peers_ changes; its values are unique
  // in the process, so a lookup cached for another transport never matches.
  static uint64_t next_peers_version();
  std::atomic<uint64_t> peers_version_{next_peers_version()};
  // Some peer listed registers GPU memory with FI_HMEM: only then do
  // capabilities vary by peer (capabilities_for looks the peer up).
  std::atomic<bool> any_peer_hmem_{false};
  std::mutex connect_mu_;
  std::unordered_map<uint64_t, ConnectWait> connect_waits_;  // under peers_mu_
  std::condition_variable connect_cv_;                       // with peers_mu_

  std::mutex export_mu_;
  std::unordered_map<RegionId, Exported> exported_;
  struct LocalMr {
    std::shared_ptr<Region> region;
    struct fid_mr* mr = nullptr;
  };
  std::unordered_map<RegionId, LocalMr> local_mrs_;  // FI_MR_LOCAL only, under export_mu_
  std::unordered_map<RegionId, Revoking> revoking_;  // under export_mu_
  // Importer: REVOKEs to answer once no op on the region is in flight.
  std::vector<std::pair<std::shared_ptr<Peer>, RegionId>> acks_due_;  // under post_mu_
  bool in_flight_on_locked(const Peer* p, RegionId region) const;
  void send_due_acks_locked();
  void finish_revoke(RegionId region, PeerId peer, bool all);

  mutable std::mutex post_mu_;
  struct Counts {
    uint64_t rma_ops = 0, combined_ops = 0, combined_calls = 0, held_calls = 0;
  } counts_;                        // under post_mu_
  std::condition_variable job_cv_;  // with post_mu_: a job's op completed
  uint32_t job_waiters_ = 0;        // threads in cancel() on job_cv_; under post_mu_
  // Most calls are never cancelled: notify only where somebody waits.
  void notify_job_waiters_locked();
  std::vector<std::unique_ptr<Op>> ops_;
  std::vector<Op*> free_ops_;
  std::deque<std::shared_ptr<Job>> queue_;  // jobs with segments still to post
  // Jobs not finished, each at its live_index (swapped out when it finishes:
  // no allocation per call); a job's transfer points at it
  // (Transfer::transport_state) while it is here, for cancel().
  std::vector<std::shared_ptr<Job>> live_jobs_;
  void add_live_locked(const std::shared_ptr<Job>& job);
  // Takes a stopped job out of queue_ (what it had not posted is dropped).
  void drop_queued_locked(const Job& job);
  void remove_live_locked(Job& job);
  std::deque<Op*> send_queue_;  // sends the provider answered EAGAIN to, in order
  uint64_t inflight_ = 0, inflight_bytes_ = 0;
  // One peer's share of the window (fabric.peer_window_percent), set at start.
  uint64_t peer_max_inflight_ = 256, peer_max_inflight_bytes_ = 64ull << 20;
  std::atomic<bool> backlog_{false};  // send_queue_ or queue_ not empty after the last pump
  std::vector<Op*> recvs_;

  std::mutex gpu_mu_;
  std::unique_ptr<staging::GpuPath> gpu_;  // under gpu_mu_; created on first use
  Status gpu_error_;
  struct fid_mr* staging_mr_ = nullptr;  // the whole pool, once (FI_MR_LOCAL)
  void* staging_desc_ = nullptr;

  std::chrono::steady_clock::time_point next_ping_{};

  // Reading the CQ: the progress thread, or a thread waiting for a small
  // transfer (progress()), which then needs no wake-up from the progress
  // thread. Such a waiter handles completions of operations only; received
  // messages, errors and everything read after them are put aside in
  // deferred_ for the progress thread, in order.
  std::mutex cq_mu_;
  std::deque<struct fi_cq_data_entry> deferred_;  // under cq_mu_
  std::atomic<bool> deferred_pending_{false};     // deferred_ not empty; set under cq_mu_
  // wake() writes the eventfd only while the progress thread sleeps (or is
  // about to): work_gen_ tells it that something came after it looked.
  enum class Sleep : uint8_t { kAwake, kOnCq, kWaiterPolls };
  std::atomic<Sleep> sleeping_{Sleep::kAwake};
  std::atomic<uint64_t> work_gen_{0};
  std::atomic<uint64_t> urgent_gen_{0};       // wake(urgent): also for a waiter-polls sleep
  std::atomic<int64_t> waiter_polled_ns_{0};  // steady_clock ns of a waiter's last poll
  std::atomic<bool> error_pending_{false};  // a waiter saw FI_EAVAIL: the progress thread reads it
};

}  // namespace ferry::fabric
