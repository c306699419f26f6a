// The tcp transport: the embedded default, any two hosts.
//
// Each peer connection is a Group of N streams (sockets). A transfer is cut
// into frames of at most `tcp.chunk_bytes` payload / `tcp.max_segments`
// segments (small iovs coalesce into one frame, large ones are chunked) and
// the frames are striped round-robin over the group's streams. The target
// receives payload with readv straight into the registered destination and
// serves reads with writev straight from registered memory.
//
// Threads: `tcp.io_threads` workers, each an epoll loop that sleeps when idle.
// A stream belongs to one worker, which alone receives on it. Sending is done
// by whichever thread holds the stream's tx_mu: the posting thread writes as
// much as the socket takes, the worker finishes on EPOLLOUT.
#pragma once

#include <sys/epoll.h>

#include <array>
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/log_limiter.h"
#include "core/spin_window.h"
#include "core/stage_trace.h"
#include "core/usable_cpus.h"
#include "transport/common/gpu_staging.h"
#include "transport/tcp/iov_cursor.h"
#include "transport/tcp/socket_util.h"
#include "transport/tcp/tcp_wire.h"
#include "transport/transport.h"

namespace ferry::tcp {

// GPU memory goes through the shared pinned staging path, one frame payload
// per slot.
using staging::DeviceCopy;
using staging::GpuPath;
using staging::GpuPathOptions;

struct TcpOptions {
  uint32_t streams = 2;
  uint32_t io_threads = 1;                 // resolved from tcp.io_threads (0: by CPU count)
  std::chrono::microseconds busy_poll{0};  // resolved from tcp.busy_poll_us
  // After serving a peer's request (the target side of a round trip; the
  // initiator's caller spins in wait() itself): tcp.serve_poll_us resolved.
  std::chrono::microseconds serve_poll{0};
  uint64_t chunk_bytes = 1 << 20;
  uint32_t max_segments = 256;
  std::chrono::milliseconds connect_timeout{5000};
  std::chrono::milliseconds user_timeout{10000};
  int sndbuf = 0;
  int rcvbuf = 0;
  uint64_t gpu_staging_bytes = 64 << 20;
  uint32_t gpu_sm_budget = 4;
  uint64_t gpu_inline_bytes = 64 << 10;
  std::chrono::microseconds gpu_inline_wait{500};
  uint64_t gpu_min_stripe = 32 << 10;
  uint16_t handshake_revision = kHandshakeRevision;  // tcp.handshake_revision
  bool trace = false;  // tcp.trace: stage trace of every transfer this engine initiates
  uint64_t trace_keep = 4096;
};

// The target's stage times for one request frame, in trailer order (tcp_wire.h
// TraceTrailerHead): indices are TraceStage - kFrameReceived.
using TargetStamps = std::array<int64_t, kTraceTrailerStages>;
constexpr size_t target_stamp(TraceStage stage) {
  return static_cast<size_t>(stage) - static_cast<size_t>(TraceStage::kFrameReceived);
}
static_assert(target_stamp(TraceStage::kResponseSent) + 1 == kTraceTrailerStages);

// A piece of local memory in a frame; device >= 0 for GPU memory.
struct Piece {
  uint8_t* ptr;
  uint64_t length;
  int device;
};
extern const OptionSpec kTcpOptionSpecs[];
extern const size_t kTcpOptionSpecCount;

// A response a stream still expects, in request order.
struct Pending {
  Op expect;
  std::shared_ptr<Transfer> transfer;
  IovCursor read_into;  // READ: where the response payload goes
  uint64_t payload_bytes = 0;
  bool dropped = false;  // frame never sent (transfer cancelled); guarded by tx_mu
  // A frame of a cancelled write already (partly) sent: its WRITE_ACK lifts
  // one count of the group's cancel fence. Set under tx_mu by cancel().
  bool fenced = false;
  bool traced = false;  // the request asked for a stage trace
  // READ into GPU memory: the pieces, and once the response arrives the
  // staging slot it lands in and the host→device copies that follow.
  std::vector<Piece> gpu_pieces;
  std::unique_ptr<StagingSlot> slot;
  std::vector<DeviceCopy> h2d;
  // ... which run after the work the caller queued on the default stream
  // before posting the read (null: none was queued).
  std::shared_ptr<const DefaultStreamMark> after;
};

struct TxFrame {
  FrameHeader header{};
  std::vector<uint8_t> aux;
  IovCursor cursor;                    // header, aux, payload
  std::shared_ptr<Transfer> transfer;  // frames reading the caller's memory
  std::shared_ptr<Pending> pending;    // set when a response is expected
  std::vector<RegionPin> pins;         // READ_RESPONSE payload stays registered
  std::unique_ptr<StagingSlot> slot;   // staged GPU bytes of the payload
  std::vector<uint8_t> detached;       // unsent rest, copied out at cancel()
  bool started = false;
  // Stage trace: a request of a traced transfer (marks its frame_sent
  // stages), or a response whose aux starts with a trace trailer (gets its
  // response_sent time when it starts onto the socket).
  bool traced = false;
};

// A response whose place in the stream's answer order is reserved while GPU
// copies finish (responses must leave in request order).
struct Deferred {
  bool ready = false;  // guarded by Stream::def_mu (the deque itself by tx_mu)
  std::unique_ptr<TxFrame> frame;
};

struct EpollTag {
  enum Kind { kStream, kListener, kWake } kind;
};

class Worker;
struct Group;

struct Stream : EpollTag, std::enable_shared_from_this<Stream> {
  Stream() : EpollTag{kStream} {}
  int fd = -1;
  Worker* worker = nullptr;
  std::string remote;  // address text for messages
  std::weak_ptr<Group> group;
  // Accepted streams: the Hello must arrive by then or the stream is closed.
  std::chrono::steady_clock::time_point hello_deadline{};

  // --- sending side: any thread, under tx_mu ---
  std::mutex tx_mu;
  std::deque<std::unique_ptr<TxFrame>> txq;
  std::deque<std::shared_ptr<Pending>> pending;
  // Responses waiting for a GPU copy, in request order; under def_mu (taken
  // after tx_mu when both are held). Adding or completing one takes only
  // def_mu, so neither the I/O thread nor a GPU completion thread waits
  // behind a sender holding tx_mu.
  std::mutex def_mu;
  std::deque<std::shared_ptr<Deferred>> deferred;
  bool want_out = false;
  bool rx_paused = false;              // EPOLLIN off while a payload waits for a staging slot
  bool cork_pending = false;           // responses queued during a receive pass
  std::atomic<bool> rx_corked{false};  // the worker is in a receive pass
  std::atomic<bool> dead{false};       // set under tx_mu; the worker reads it unlocked
  bool closed = false;

  // --- receiving side: owning worker only ---
  // kWaitSlot: a payload bound for GPU memory waits for a staging slot;
  // reading is paused (rx_paused) until the worker hands one over.
  // kHelloMetadata: an accepted stream receives the connecting engine's
  // metadata (handshake revision 2) into `aux`.
  enum class Rx { kHello, kHelloMetadata, kHeader, kAux, kPayload, kWaitSlot } rx = Rx::kHeader;
  bool handshaking() const { return rx == Rx::kHello || rx == Rx::kHelloMetadata; }
  uint8_t head[sizeof(FrameHeader)];
  size_t head_got = 0;
  FrameHeader hdr{};
  std::vector<uint8_t> aux;
  size_t aux_got = 0;
  IovCursor payload;
  uint64_t discard_left = 0;
  std::vector<RegionPin> pins;
  Status write_verdict;
  std::shared_ptr<Pending> reading;   // READ_RESPONSE being received
  std::unique_ptr<StagingSlot> slot;  // WRITE into GPU memory: payload lands here
  std::vector<DeviceCopy> h2d;        // ... and is copied to the device after
  std::vector<Piece> wait_pieces;     // a WRITE's pieces while it waits for a slot
  // The request being received asked for a stage trace (kFlagTrace): its
  // target stage times so far, sent back in its response's trailer.
  bool rx_traced = false;
  TargetStamps rx_stamps{};
  size_t rx_trailer = 0;  // a response's trace trailer bytes at the start of aux
};

// A request posted while its group's cancel fence stands: sent, in order,
// when the fence is lifted.
struct HeldPost {
  std::shared_ptr<Transfer> transfer;
  std::vector<std::unique_ptr<TxFrame>> frames;  // sent as enqueue() would
  // A write from GPU memory: its frames before their staging copies (a held
  // request holds no staging slot).
  std::vector<std::pair<std::unique_ptr<TxFrame>, std::vector<Piece>>> staged;
};

struct Group {
  PeerId peer = 0;
  uint64_t nonce = 0;
  bool outgoing = false;
  std::string remote;
  std::vector<std::shared_ptr<Stream>> streams;  // null slots until arrived (incoming)
  size_t arrived = 0;
  std::atomic<bool> dead{false};
  std::atomic<uint32_t> next_stream{0};
  // The cancel fence (TcpTransport::cancel). Frames of a cancelled write
  // already sent on one stream are placed by the target after whatever
  // later goes over another, so requests posted after cancel() wait here
  // until those frames are acknowledged. `held` is the only thing a post
  // reads when no write was cancelled.
  std::atomic<bool> held{false};  // fence up or backlog not yet sent: new requests queue
  std::mutex fence_mu;            // after tx_mu when both are held
  uint64_t fenced = 0;            // fenced frames not yet acknowledged; fence_mu
  bool draining = false;          // a thread sends the backlog; fence_mu
  std::deque<HeldPost> backlog;   // fence_mu
};

class TcpTransport;

class Worker {
 public:
  Worker(TcpTransport& transport, int index);
  ~Worker();
  Status start();
  void stop();
  void adopt(const std::shared_ptr<Stream>& stream);
  void watch_listener(int fd);
  // Removes a stream's socket from the epoll set (before it is closed).
  void unwatch(int fd);
  // Asks the loop to flush the stream (its tx_mu was busy); any thread.
  void request_flush(std::shared_ptr<Stream> stream);
  // Asks the loop to let go of revoked regions (TcpTransport::release_revoked).
  void request_release();
  // Called with s.tx_mu held: tracks EPOLLOUT interest.
  void want_writable(Stream& s, bool on);
  // Called with s.tx_mu held: EPOLLIN interest off while the stream waits
  // for a staging slot (errors and hang-ups are still reported).
  void pause_reading(Stream& s, bool paused);
  // Hands a staging slot to a stream waiting for one; any thread. The loop
  // resumes the stream's receive (TcpTransport::resume_receive).
  void request_resume(std::shared_ptr<Stream> stream, std::unique_ptr<StagingSlot> slot);
  int index() const { return index_; }
  // This loop has begun receiving a peer's request (its thread only): it
  // polls for serve_poll after the batch (TcpOptions::serve_poll).
  void note_request() { served_request_ = true; }
  uint8_t* discard_buffer() { return discard_.data(); }
  size_t discard_size() const { return discard_.size(); }

 private:
  void run();
  // Sets the stream's epoll interest from want_out and rx_paused; tx_mu held.
  void watch_events(Stream& s);
  // Closes accepted streams whose Hello did not arrive in time and recounts
  // those still handshaking.
  void expire_handshakes();
  static constexpr std::chrono::milliseconds kHandshakeCheck{100};
  TcpTransport& transport_;
  const int index_;
  int epfd_ = -1;
  int wakefd_ = -1;
  int listen_fd_ = -1;
  EpollTag wake_tag_{EpollTag::kWake};
  EpollTag listen_tag_{EpollTag::kListener};
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::unordered_map<Stream*, std::shared_ptr<Stream>> streams_;
  std::atomic<uint32_t> handshaking_{0};
  std::atomic<bool> release_requested_{false};
  std::vector<std::shared_ptr<Stream>> flush_requests_;  // guarded by mu_
  std::vector<std::pair<std::shared_ptr<Stream>, std::unique_ptr<StagingSlot>>>
      resume_requests_;  // guarded by mu_
  std::vector<uint8_t> discard_;
  SpinWindow spin_{usable_cpus()};  // this thread's only
  bool served_request_ = false;     // this thread's only
};

// At most this many lines about hostile connections per window, one
// summary for the rest.
constexpr uint32_t kHostileLogBurst = 5;
constexpr std::chrono::milliseconds kHostileLogWindow{10000};

class TcpTransport final : public Transport {
 public:
  // "ferryN": this engine's ordinal in the process, prefix of its thread names.
  const std::string& thread_prefix() const { return thread_prefix_; }
  const TcpOptions& options() const { return opt_; }
  TcpTransport() = default;
  ~TcpTransport() override;

  std::string_view name() const override { return "tcp"; }
  TransportCaps capabilities() const override;
  Status start(const TransportContext& context) override;
  void shutdown(const Status& reason) override;
  Bytes local_address() const override;
  std::string local_address_text() const override { return advertised_; }
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

  // --- used by workers ---
  void on_accept(int listen_fd);
  // Receives and handles frames until the socket would block.
  void on_readable(Stream& s);
  void receive_pass(Stream& s);
  void on_writable(Stream& s);
  // Marks the stream and its group failed, fails their transfers, closes fds.
  void fail_stream(Stream& s, const Status& reason);
  // An accepted stream sent no complete Hello within tcp.connect_timeout_ms.
  void expire_handshake(Stream& s);
  void flush_hostile_log() { hostile_log_.flush_due(); }
  // Drops the stream's hold on revoked regions: the rest of a WRITE arriving
  // into one is discarded, the unsent rest of a frame sent from one is copied
  // out. Owning worker only.
  void release_revoked(Stream& s);
  // Gives a stream waiting for a staging slot its slot and goes on reading.
  // Owning worker only.
  void resume_receive(Stream& s, std::unique_ptr<StagingSlot> slot);
  // The connection failed (EPOLLERR/EPOLLHUP) while the stream waited for a
  // staging slot. Owning worker only.
  void on_broken_while_waiting(Stream& s);

 private:
  void wait_for_slot(Stream& s);
  // The waiter that passes a released slot to `s`'s worker.
  std::function<void(std::unique_ptr<StagingSlot>)> resume_with_slot(Stream& s);
  Result<std::shared_ptr<Group>> open_group(const SocketAddress& address, PeerId expected_peer);
  // The connecting side of stream `index`'s handshake on `fd`; `metadata`
  // (ours, on the first stream) is exchanged where the peer speaks revision
  // 2. Returns the peer's engine id.
  Result<PeerId> handshake_out(int fd, const Group& group, uint32_t index, ByteView metadata,
                               PeerId expected_peer);
  std::shared_ptr<Group> primary(PeerId peer) const;
  // What a WRITE or READ needs first: the peer's live group, whether the
  // local memory is GPU memory, and the payload size of its frames.
  struct PostPlan {
    std::shared_ptr<Group> group;
    bool local_gpu = false;
    uint64_t chunk = 0;
  };
  Result<PostPlan> plan_post(PeerId peer, const std::vector<Segment>& segments);
  // Sends a request's frames, or queues them while the group's cancel fence
  // stands (then Ok; a failure later fails `transfer`).
  Status enqueue(Group& group, const std::shared_ptr<Transfer>& transfer,
                 std::vector<std::unique_ptr<TxFrame>> frames);
  // Frame k on stream (next_stream + k) % n.
  Status send_frames(Group& group, std::vector<std::unique_ptr<TxFrame>> frames);
  // --- the cancel fence ---
  // Queues `post` if the group is held (then true, `post` moved from).
  bool hold(Group& group, HeldPost& post);
  // cancel() of write `t`: its frames not yet started on `s` will never be;
  // those (partly) sent raise the fence until acknowledged. tx_mu held.
  static void fence_sent_frames(Group& group, Stream& s, const Transfer& t);
  // cancel() of `t`: its frames on `s` not yet started leave the queue now,
  // with the responses they would have had. tx_mu held.
  static void drop_unsent_frames(Stream& s, const Transfer& t);
  // A fenced frame's WRITE_ACK arrived on `s`.
  void unfence(Stream& s);
  // Sends the backlog while no fence stands; lowers `held` once it is empty.
  void release_held(Group& group);
  void send_held(Group& group, HeldPost& post);
  bool enqueue_on(Stream& s, std::unique_ptr<TxFrame> frame);
  // The same, sent by the stream's I/O thread rather than this one: for the
  // GPU path's watcher, which must not spend a send (~5 us on loopback) per
  // frame while it polls every handed-off copy.
  bool enqueue_for_worker(Stream& s, std::unique_ptr<TxFrame> frame);
  // Sends queued frames until EAGAIN; tx_mu held. False: the stream failed.
  bool flush_locked(Stream& s, Status* error);
  void flush(Stream& s);
  // Answers the request now in `s` (its trace stamps, if it asked for them).
  void send_response(Stream& s, Op op, TransferId id, const Status& status);
  // `stamps` non-null: the request asked for a stage trace; the response
  // carries them in a trailer.
  static std::unique_ptr<TxFrame> make_response(Op op, TransferId id, const Status& status,
                                                const TargetStamps* stamps = nullptr);
  // Sends a response now, or behind responses still waiting for GPU copies.
  void respond(Stream& s, std::unique_ptr<TxFrame> frame);
  std::shared_ptr<Deferred> defer(Stream& s);
  void complete_deferred(Stream& s, const std::shared_ptr<Deferred>& d,
                         std::unique_ptr<TxFrame> frame);
  // The GPU staging path, created on first use. NotSupported with the reason.
  Result<GpuPath*> gpu();
  void post_staged(Group& group, const std::shared_ptr<Transfer>& transfer,
                   std::vector<std::pair<std::unique_ptr<TxFrame>, std::vector<Piece>>> frames);
  void on_response(const std::shared_ptr<Pending>& p, const Status& status);
  void finish_unit(const std::shared_ptr<Transfer>& t);
  // Stage trace: starts `t`'s trace when tcp.trace is on (true: its frames
  // ask for the target's stamps).
  bool begin_trace(Transfer& t, const std::vector<Segment>* segments);
  // The response to traced request `p` arrived on `s`: merges the target's
  // stamps from its trailer, then marks response_received unless
  // `payload_follows`.
  static void absorb_trailer(const Stream& s, const Pending& p, bool payload_follows);
  void fail_transfer(Transfer& t, const Status& status);

  // Receive-side steps; each returns false when the socket would block or the
  // stream failed (then `s.dead` is set).
  bool rx_hello(Stream& s);
  bool rx_hello_metadata(Stream& s);
  // Answers a Hello with a refusal naming `why` and fails the stream; false.
  bool refuse_hello(Stream& s, StatusCode code, const std::string& why);
  // The handshake of accepted stream `s` is done: it carries frames now, and
  // the group is up once every stream arrived.
  void stream_arrived(Stream& s, const std::shared_ptr<Group>& group);
  bool rx_header(Stream& s);
  bool rx_aux(Stream& s);
  bool rx_payload(Stream& s);
  Status on_frame(Stream& s);
  Status begin_write(Stream& s);
  Status serve_read(Stream& s);
  Status begin_read_response(Stream& s);
  Status take_response(Stream& s, Op expect, std::shared_ptr<Pending>* out, bool pop);
  void finish_payload(Stream& s);
  void close_stream(Stream& s);
  std::string peer_name(const Stream& s) const;

  TransportContext ctx_;
  TcpOptions opt_;
  int listen_fd_ = -1;
  SocketAddress bound_;
  std::string advertised_;  // "ip:port,ip:port"
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<uint32_t> next_worker_{0};

  mutable std::mutex mu_;
  std::unordered_map<PeerId, std::shared_ptr<Group>> primary_;
  std::map<std::pair<PeerId, uint64_t>, std::shared_ptr<Group>> groups_;
  std::mutex connect_mu_;
  bool stopped_ = false;
  std::string thread_prefix_ = "ferry";
  std::mutex gpu_mu_;
  std::unique_ptr<GpuPath> gpu_;
  Status gpu_error_;
  std::shared_ptr<TraceLog> trace_log_;  // tcp.trace on: where finished traces go
  // Requests queued behind a cancel fence (counters()).
  std::atomic<uint64_t> fence_held_requests_{0};
  // Lines about connections closed for bad input or a handshake never
  // finished: anyone who reaches the port can cause them, so they are
  // rate-limited (docs/reliability.md, "Hostile input").
  LogLimiter hostile_log_{"ferry tcp: connections closed for bad input or an unfinished handshake",
                          kHostileLogBurst, kHostileLogWindow};
};

}  // namespace ferry::tcp
