// The shm transport: host memory between two processes of one host, in a
// single copy by cross-memory attach (process_vm_readv / process_vm_writev)
// where the kernel allows it, else through shared memory (staging.h).
//
// Target-driven: the process that owns the registered region does every
// copy. A WRITE_REQ names the initiator's addresses and the remote access
// requests; the target checks every segment with RegionRegistry::check_remote
// (key, range, access, revocation) and that the region is host memory, then
// pulls the bytes with process_vm_readv. A READ_REQ is checked the same way
// and pushed with process_vm_writev. So the target is exactly as strict as
// tcp, the RegionPins held during the copy make deregistration wait, and no
// grant/revoke protocol is needed. The initiator's memory is never checked by
// the target: the initiator's engine validated it, and the kernel's
// permission check (ptrace rules) is what lets the target touch it at all.
//
// Control channel: one Unix stream socket per connection, listener at
// <shm.socket_dir>/ferry-<engine id>-<pid>.sock (a pathname socket, so it
// works across network namespaces that share the filesystem). The peer's pid
// is SO_PEERCRED's, never one the peer claims. The handshake tries, in both
// directions, a real read of a random value from the peer with cross-memory
// attach (shm_wire.h has the messages). If either read is refused (ptrace
// policy, another user, another user namespace) the connection runs in
// staging mode: the bytes pass through two sealed memfds the handshake
// exchanged (SCM_RIGHTS), copied in by one side and out by the other, with
// the same checks on the target. shm.mode forces either mode; the choice is
// logged per connection and shown by peer_address().
//
// Threads: one epoll I/O thread reads every connection (it never blocks on a
// send, so both ends always drain their sockets and blocking sends cannot
// deadlock); shm.copy_threads workers validate, copy, notify and answer.
// A large transfer is cut into requests of at most shm.max_request_bytes
// (4 MiB), which the workers take from one queue: so one transfer is copied
// by up to shm.copy_threads cores at once, each request still checked whole
// before any of its bytes move. Small requests (shm.inline_bytes) are served
// by the I/O thread itself, which then polls its sockets for shm.busy_poll_us
// before it sleeps again, so a peer's next small request finds it awake.
// The answer to a small request is read by the caller's own thread where it
// waits or tests for it (progress()): it polls the connection's socket, so
// no thread of the initiator has to be woken to hand the answer over.
// Initiators (application threads) send requests under the connection's
// send mutex.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cuda/default_stream_mark.h"
#include "transport/shm/cma.h"
#include "transport/shm/shm_request_ring.h"
#include "transport/shm/shm_wire.h"
#include "transport/shm/staging.h"
#include "transport/transport.h"

namespace ferry::shm {

extern const OptionSpec kShmOptionSpecs[];
extern const size_t kShmOptionSpecCount;

struct ShmOptions {
  std::string socket_dir = "/tmp";
  std::chrono::milliseconds connect_timeout{5000};
  bool allow_ptrace = true;
  uint32_t max_request_segments = kMaxRequestSegments;
  uint64_t max_request_bytes = 4 << 20;
  uint32_t copy_threads = 1;
  std::chrono::milliseconds cancel_timeout{250};
  uint64_t inline_bytes = 256 << 10;
  std::chrono::microseconds busy_poll{50};
  bool caller_polls = true;
  std::chrono::milliseconds send_timeout{10000};
  Mode mode = Mode::kAuto;
  uint64_t staging_bytes = 32 << 20;
  // engine.gpu_same_host_path lets shm stage GPU memory (auto, shm_staged):
  // cross-memory-attach connections then keep both staging areas too.
  bool gpu_areas = true;
  // Small requests through shared-memory request rings (shm_request_ring.h).
  bool request_ring = false;
  uint64_t ring_max_bytes = 256 << 10;
};

// Copy workers woken for any task; the rest of shm.copy_threads only for a
// backlog of them.
constexpr uint32_t kEagerCopyThreads = 4;

// shm.copy_threads=0: the copy threads for a process that may use `cpus` CPUs.
uint32_t default_copy_threads(uint32_t cpus);

constexpr uint64_t kNoRange = ~uint64_t{0};

// Requests of at most this many bytes keep the I/O thread polling for
// shm.busy_poll_us after them.
constexpr uint64_t kBusyPollMaxBytes = 64 << 10;

// A request this side sent and awaits the answer of.
struct Pending {
  std::shared_ptr<Transfer> transfer;
  // Staging mode: the range of our area the request holds until answered
  // (kNoRange: none), and for a read where its bytes go then (local: the
  // destination, remote: the offset in our area).
  uint64_t range = kNoRange;
  std::vector<CopyPiece> copy_out;
  std::vector<int> copy_out_devices;  // per piece: its GPU, -1 host memory (empty: all host)
  // GPU destinations: the caller's default-stream work when it posted the read.
  std::shared_ptr<const DefaultStreamMark> after;
  // The request's payload bytes (whether it is small enough for the ring).
  uint64_t bytes = 0;
  // How it went: on the socket (counted in socket_unanswered) or in the
  // request ring's slot `ring_slot`.
  bool on_socket = false;
  uint32_t ring_slot = 0;
};

// A staged request not sent yet: it waits for a range of our area (or, a
// notification, which needs none, for the cancel fence to fall). Its
// segments' addresses and its copies' offsets are relative to the range.
struct StagedRequest {
  std::shared_ptr<Transfer> transfer;
  Op op = Op::kWriteReq;
  std::vector<WireSegment> segments;
  std::vector<CopyPiece> copies;  // local: the caller's memory; remote: offset in the range
  std::vector<int> devices;  // per copy: the GPU of its local memory, -1 host (empty: all host)
  // Local GPU memory: the caller's default-stream work when it posted (a
  // write's source may still be being filled there).
  std::shared_ptr<const DefaultStreamMark> after;
  uint64_t bytes = 0;
  bool embed_notification = false;
  Bytes notification;
};

struct Connection : std::enable_shared_from_this<Connection> {
  ~Connection();

  enum class State { kAwaitHello, kAwaitHelloDone, kOpen };
  int fd = -1;
  pid_t pid = 0;    // the peer's, from SO_PEERCRED
  int pidfd = -1;   // the peer process itself (see cma.h open_pidfd)
  PeerId peer = 0;  // set once its HELLO / HELLO_ACK is read
  std::string via;  // the socket path the connection runs through
  bool outgoing = false;
  // Our probe value; its address travels in the handshake, so it lives as
  // long as the connection.
  uint64_t probe_value = 0;
  // steady_clock ticks when a look at the socket and the pidfd last found the
  // peer there (shm_copy_workers.cc, initiator_still_there): a pull (a WRITE's
  // bytes) shortly after it needs no look of its own.
  std::atomic<int64_t> initiator_seen{0};
  std::atomic<bool> dead{false};  // set once, under mu, by fail_connection

  // How bytes move, fixed by the handshake before the connection is used.
  bool staged = false;    // staging mode (else cross-memory attach)
  std::string mode_text;  // for logs and peer_address()
  StagingArea own;        // staging: the bytes of our requests; we hand out its ranges
  StagingArea theirs;     // staging: the bytes of the peer's requests (offsets checked)
  // Cross-memory attach mode with both areas kept (kFeatureGpuAreas): host
  // memory still goes by cross-memory attach, GPU memory through the areas.
  bool gpu_areas = false;
  // GPU memory can go through the areas (staging mode, or gpu_areas).
  bool stages_gpu() const { return staged || gpu_areas; }
  // The areas pinned with the CUDA runtime on their first GPU copy, so the
  // copy engine reaches them directly: 0 not tried, 1 pinned, -1 refused
  // (copies still work, from pageable memory). Under pin_mu.
  std::mutex pin_mu;
  int own_pinned = 0;
  int theirs_pinned = 0;
  // Under staging_mu: the ranges of `own` in use, the requests waiting for
  // one (in order), and whether a copy worker is draining them. Invariant:
  // while the backlog is not empty a range is in use (its release drains)
  // or a drain is under way.
  std::mutex staging_mu;
  StagingRing ring;
  std::deque<StagedRequest> backlog;
  bool draining = false;
  // The cancel fence: ranges held by requests of cancelled writes that the
  // peer has not answered yet. Until their answers arrive the peer may still
  // be copying those bytes into its region, so nothing else is sent: every
  // request waits in the backlog, which the release of the last fenced range
  // drains. So a request posted after cancel() returned reaches the peer
  // only once the cancelled write's copies are over, and none of them can
  // overwrite it. Lock order: staging_mu, then mu.
  std::unordered_set<uint64_t> fence;
  // Standalone notifications the fence held, in the backlog or being sent by
  // a drain: while there are any, later ones queue behind them, so
  // notifications keep their order.
  uint32_t held_notifications = 0;

  // One frame at a time on the socket (initiators and copy workers).
  std::mutex send_mu;

  // Requests this side sent and still expects answers for.
  std::mutex mu;
  std::condition_variable idle_cv;                // an entry of in_flight dropped to 0, or dead
  bool established = false;                       // under mu; on_peer_up was called
  std::unordered_map<uint64_t, Pending> pending;  // request id →
  std::unordered_map<const Transfer*, uint32_t> in_flight;  // for cancel()

  // The socket's reader: the I/O thread, or a caller's thread polling for
  // the answer to its transfer (ShmTransport::progress). Guards what follows.
  std::mutex rx_mu;
  State state = State::kOpen;
  std::chrono::steady_clock::time_point handshake_deadline{};
  Bytes rx;  // received bytes not yet handled
  size_t rx_len = 0;
  std::vector<int> rx_fds;       // descriptors received (a HELLO_DONE's staging area)
  std::string cma_refusal;       // accepted connections: why our probe of the peer failed
  Mode peer_mode = Mode::kAuto;  // accepted connections: the peer's shm.mode

  // --- request rings (shm.request_ring, shm_request_ring.h) ---
  // Chosen by the handshake; then each side has a ring for the requests it
  // initiates (ring_out, handed to the peer) and maps the peer's (ring_in).
  bool rings = false;
  RequestRing ring_out;
  // Initiator, under mu: the next sequence to post, the request id in each
  // slot (0: free), and the requests on the socket not answered yet. A
  // request goes by the ring only while none is (and its slot is free): the
  // target serves the ring before every socket request it reads, so requests
  // keep the order they were posted in either way.
  uint64_t ring_next = 0;
  uint64_t ring_ids[kRingSlots] = {};
  // The slots in flight, one bit each, for a reader of answers that looks
  // without the lock (set and cleared under mu).
  std::atomic<uint64_t> ring_busy[kRingSlots / 64] = {};
  std::atomic<uint32_t> socket_unanswered{0};
  std::atomic<uint32_t> ring_unanswered{0};
  // Target: the peer's ring, mapped once its descriptor arrived (the
  // HELLO_DONE's second one, or a RING frame); served in order under
  // ring_in_mu by one thread at a time.
  std::mutex ring_in_mu;
  RequestRing ring_in;
  std::atomic<bool> ring_in_ready{false};
  uint64_t ring_in_next = 0;  // under ring_in_mu
};

// Work for a copy worker: serve a request of `conn`'s peer, or (notify_for
// set) send a multi-request write's notification now that all of it landed.
struct Task {
  std::shared_ptr<Connection> conn;
  Request request;
  std::shared_ptr<Transfer> notify_for;
  Bytes response;      // set: only send this frame (the I/O thread could not)
  bool drain = false;  // set: send the connection's staged requests that now fit
  // Set (range != kNoRange): a staged read was answered; copy its bytes out
  // of our area, give the range back and count the answer.
  Pending answered;
};

class ShmTransport final : public Transport {
 public:
  ShmTransport() = default;
  ~ShmTransport() override;

  std::string_view name() const override { return "shm"; }
  TransportCaps capabilities() const override;
  // GPU memory too (every route) to a peer whose connection stages it:
  // staging mode, or cross-memory attach with GPU areas (kFeatureGpuAreas).
  TransportCaps capabilities_for(PeerId peer) const override;
  std::string peer_limits(PeerId peer) const override;
  Status start(const TransportContext& context) override;
  void shutdown(const Status& reason) override;
  Bytes local_address() const override;
  std::string local_address_text() const override { return "unix:" + socket_path_; }
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
  // copy_threads, requests_copied (requests whose bytes moved), and
  // peak_parallel_copies (the most requests copied at once).
  std::vector<std::pair<std::string, uint64_t>> counters() const override;
  // Nothing to do: a copy holds its pins only for one process_vm_* batch of
  // at most shm.max_request_bytes (no peer can stall it), and every request
  // checks Region::revoked before it copies.
  void release_revoked_regions() override {}
  // The waiting (or testing) thread reads the transfer's connection itself:
  // answers are handled at once, with no wake-up of the I/O thread on the
  // way. Returns at once when another thread is reading it.
  void progress(const Transfer& transfer) override;
  void test_progress(const Transfer& transfer) override { progress(transfer); }
  // A waiter goes to sleep: answers in the request ring must wake it now.
  void stop_polling(const Transfer& transfer, bool finished) override;
  // Each poll is a recvmsg (about a microsecond): a few pauses between two.
  uint32_t progress_spins() const override { return 16; }

 private:
  // --- set-up ---
  Status read_options();
  Status open_listener();
  Status handshake_out(Connection& c, const ShmAddress& address, PeerId expected_peer,
                       std::chrono::steady_clock::time_point deadline);
  // The connecting side's choice of mode once the HELLO_ACK is in: probes
  // the peer unless staging is settled already, maps the peer's area and
  // creates ours for staging. The HELLO_DONE to send, or why to refuse.
  Result<HelloDone> choose_mode(Connection& c, const HelloAck& ack, std::vector<int>& fds);
  // Makes an open connection usable: maps it by peer, calls on_peer_up.
  Status establish(const std::shared_ptr<Connection>& c);
  void watch(const std::shared_ptr<Connection>& c);

  // --- I/O thread ---
  void io_loop();
  void on_accept();
  void on_readable(Connection& c);
  // Handles every complete frame in c.rx; an error closes the connection.
  Status parse_frames(Connection& c);
  Status on_frame(Connection& c, const FrameHeader& h, ByteView body);
  Status on_hello(Connection& c, const FrameHeader& h, ByteView body);
  Status on_hello_done(Connection& c, ByteView body);
  Status on_response(Connection& c, ByteView body);
  Status on_cancel(Connection& c, ByteView body);
  void expire_handshakes();

  // --- copy workers ---
  void worker_loop(int index);
  void submit(Task task);
  void serve(Connection& c, Request& request);
  // Checks and copies; the verdict to answer, or nothing when the request is
  // dropped (the initiator is gone or gave up on us).
  std::optional<Status> execute(Connection& c, Request& request);
  void serve_inline(const std::shared_ptr<Connection>& c, Request& request);
  bool try_send_now(Connection& c, const Bytes& frame);
  // The checks of every segment of `request`; fills pins and copy pieces
  // (staged: their remote side is an offset in the peer's area, checked
  // against its size here).
  Status validate(const Connection& c, const Request& request, std::vector<RegionPin>* pins,
                  std::vector<CopyPiece>* pieces, std::vector<int>* devices) const;
  void send_write_notification(const std::shared_ptr<Connection>& c,
                               const std::shared_ptr<Transfer>& t);

  // --- initiator side ---
  Result<std::shared_ptr<Connection>> live_connection(PeerId peer) const;
  Status post(PeerId peer, const std::shared_ptr<Transfer>& t, const std::vector<Segment>& segments,
              Op op);
  // Registers request `id` of `t` as pending and sends it. Cancelled: `t`
  // was cancelled (or failed) first, nothing was sent. Staging: `entry`
  // holds the request's range of our area (given back if nothing is sent)
  // and `copy_in` the write's bytes to place there first.
  Status send_request(const std::shared_ptr<Connection>& c, const std::shared_ptr<Transfer>& t,
                      uint64_t id, const Bytes& frame, Pending entry = {},
                      std::span<const CopyPiece> copy_in = {},
                      std::span<const int> copy_in_devices = {},
                      const DefaultStreamMark* after = nullptr);
  // Staging: sends `request` now if a range of our area is free, none waits
  // before it, no cancel fence is up and `*budget` (the bytes the posting
  // thread may still copy, one area's worth per post) allows; else queues it
  // for a copy thread and zeroes the budget. post() never waits for the
  // peer, nor copies more than an area's worth itself.
  Status stage(const std::shared_ptr<Connection>& c, StagedRequest request, uint64_t* budget);
  // Copies a staged request's bytes into range `at` (writes) and sends it; a
  // notification the cancel fence held (at: kNoRange) is only sent.
  Status send_staged(const std::shared_ptr<Connection>& c, StagedRequest& request, uint64_t at);
  // Staging: queues a standalone notification behind the cancel fence and
  // the notifications it held (Connection::held_notifications); false when
  // neither is there: send it now.
  bool hold_notification(const std::shared_ptr<Connection>& c, const std::shared_ptr<Transfer>& t,
                         Bytes& payload);
  // A copy worker: sends queued requests while ranges are free and no cancel
  // fence is up.
  void drain_backlog(const std::shared_ptr<Connection>& c);
  // Gives a range back (an answer came: if it belonged to a cancelled write,
  // the fence falls with the last such); starts a drain if requests wait.
  void release_range(Connection& c, uint64_t offset);
  // A staged read's bytes, from our area to their destinations, unless the
  // transfer was cancelled or failed.
  void copy_out(Transfer& t, Connection& c, const Pending& p);
  // After an answer (and a staged read's copy out): the range back, the
  // transfer's count down, and its completion after the last.
  void finish_answer(Connection& c, const Pending& p);
  // After the last response of `t`: the write's notification, or completion.
  void finish(const std::shared_ptr<Connection>& c, const std::shared_ptr<Transfer>& t);

  // --- request rings (shm_ring.cc) ---
  // Initiator: posts `frame` in the ring if it may go there (entry.bytes
  // small enough, no socket request unanswered, its slot free); under c.mu,
  // with `id` registered pending. False: send it on the socket.
  bool ring_post_locked(Connection& c, uint64_t id, const Bytes& frame, Pending& entry);
  // After a ring post: wakes the peer unless it polls its rings.
  void ring_wake_peer(Connection& c);
  // Initiator: handles every answer in our ring (any thread, each once).
  void ring_harvest(Connection& c);
  // Target: serves the requests posted in the peer's ring, in order; the
  // number served. `wait`: take the ring even if another thread serves it.
  uint32_t ring_serve(Connection& c, bool wait);
  // A RING frame: maps the peer's ring (its descriptor in c.rx_fds).
  Status on_ring(Connection& c, ByteView body);
  // The handshake chose rings: our ring for the peer.
  Status make_ring_out(Connection& c);
  // The I/O thread's ring work per loop: serve and harvest, the polling flag
  // while busy; the longest it may sleep (-1: no limit).
  int ring_io_turn(bool busy);
  // Answers of a socket RESPONSE or a ring slot (ring_slot >= 0).
  Status handle_response(Connection& c, const Response& response, int ring_slot);

  // --- both ---
  // Sends one whole frame (blocking, bounded by shm.send_timeout_ms).
  Status send_frame(Connection& c, const Bytes& frame);
  // Marks `c` dead, fails its pending transfers and, if it carried the peer,
  // reports the peer down. `verbatim`: transfers fail with `reason` itself
  // (shutdown) instead of a PeerDisconnected naming the connection.
  void fail_connection(Connection& c, const Status& reason, bool verbatim = false);
  void fail_transfer(Transfer& t, const Status& status);
  std::string describe(const Connection& c) const;

  TransportContext ctx_;
  ShmOptions opt_;
  // This process can copy GPU memory (a CUDA device answers): only then does
  // shm carry GPU memory, and keep the areas for it beside cross-memory attach.
  bool cuda_here_ = false;
  std::string thread_prefix_ = "ferry";
  std::string socket_path_;
  int listen_fd_ = -1;
  int epfd_ = -1;
  int wakefd_ = -1;
  std::thread io_thread_;
  std::atomic<bool> io_stop_{false};
  int handshaking_ = 0;  // I/O thread only

  // Every connection the I/O thread watches (handshaking and open).
  std::mutex io_mu_;
  std::unordered_map<Connection*, std::shared_ptr<Connection>> watched_;

  // Copy workers and their queue.
  std::vector<std::thread> workers_;
  std::mutex task_mu_;
  std::condition_variable task_cv_;     // workers below kEagerCopyThreads wait here
  std::condition_variable backlog_cv_;  // the others: woken only while tasks queue up
  std::deque<Task> tasks_;
  bool workers_stop_ = false;  // under task_mu_

  mutable std::mutex mu_;
  bool started_ = false;
  bool stopped_ = false;
  std::unordered_map<PeerId, std::shared_ptr<Connection>> primary_;
  std::vector<std::shared_ptr<Connection>> open_;  // established, not yet failed
  std::unordered_map<PeerId, std::string> lost_;   // why a peer went down
  std::mutex connect_mu_;
  std::atomic<uint64_t> next_request_id_{1};

  // counters()
  std::atomic<uint64_t> requests_copied_{0};
  std::atomic<uint32_t> copies_in_flight_{0};
  std::atomic<uint32_t> peak_parallel_copies_{0};
  // steady_clock ticks when a peer's request was last read: the I/O thread
  // polls for shm.busy_poll_us after it.
  std::atomic<int64_t> last_request_ticks_{0};
  // Connections with request rings, for the I/O thread (under io_mu_), and
  // a generation it compares to its copy's.
  std::vector<std::shared_ptr<Connection>> ring_conns_;
  std::atomic<uint64_t> ring_conns_gen_{0};
  std::vector<std::shared_ptr<Connection>> io_ring_conns_;  // I/O thread's copy
  uint64_t io_ring_conns_gen_ = 0;
  bool io_rings_flagged_ = false;             // I/O thread: target_polling raised in the rings
  std::atomic<uint64_t> ring_posted_{0};      // our requests that went by the ring (counters())
  std::atomic<uint64_t> ring_requests_{0};    // requests served from rings (counters())
  std::atomic<uint64_t> ring_wakes_sent_{0};  // RING_WAKE frames sent (counters())
};

}  // namespace ferry::shm
