// tcp transport: the data path. Building frames from segments, sending them,
// receiving frames and answering requests.
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <climits>

#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/tcp/tcp_transport.h"

namespace ferry::tcp {
namespace {

constexpr int kMaxIov = 1024;         // IOV_MAX on Linux
constexpr int kFramesPerWakeup = 64;  // fairness between streams of a worker

std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

FrameHeader make_header(Op op, TransferId id) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.op = static_cast<uint8_t>(op);
  h.transfer_id = id;
  return h;
}

WireSegment to_wire(const RemoteAccessRequest& r, uint64_t extra_offset, uint64_t length) {
  WireSegment w{};
  w.region_id = r.region_id;
  w.adv_offset = r.adv_offset;
  w.adv_length = r.adv_length;
  w.key = r.key;
  w.offset = r.offset + extra_offset;
  w.length = length;
  w.access = r.access;
  return w;
}

// Cuts segments into frames of at most `chunk` payload bytes and `max_segs`
// pieces. Pieces fill frames exactly, so small iovs coalesce and large ones
// are chunked. `emit(segment, piece_local, wire_segment)` appends to the open frame;
// `close()` seals it.
template <typename Emit, typename Close>
void cut_frames(const std::vector<Segment>& segments, uint64_t chunk, uint32_t max_segs, Emit emit,
                Close close) {
  uint64_t frame_bytes = 0;
  uint32_t frame_segs = 0;
  for (const Segment& seg : segments) {
    uint64_t done = 0;
    while (done < seg.length) {
      const uint64_t piece = std::min(seg.length - done, chunk - frame_bytes);
      emit(seg, seg.local + done, to_wire(seg.remote, done, piece));
      done += piece;
      frame_bytes += piece;
      if (frame_bytes == chunk || ++frame_segs == max_segs) {
        close();
        frame_bytes = 0;
        frame_segs = 0;
      }
    }
  }
  if (frame_bytes > 0) close();
}

uint64_t total_bytes(const std::vector<Segment>& segments) {
  uint64_t n = 0;
  for (const Segment& seg : segments) n += seg.length;
  return n;
}

// A transfer smaller than one chunk per stream is cut finer, so that every
// stream (and the target's I/O thread behind it) carries a share: a blocking
// 1 MiB write over 2 streams goes as 2 x 512 KiB frames received in parallel,
// not as one 1 MiB frame on one stream (2.45 -> 3.43 GB/s, A/B median of 7).
// Host memory: shares below 512 KiB lost (256 KiB: 2.15 -> 1.62 GB/s).
constexpr uint64_t kMinStripe = 512 << 10;
// GPU memory on either side: tcp.gpu_min_stripe_bytes (32 KiB). Each frame's
// staging copies (a few microseconds each, on both sides) run in parallel
// with the other frames' and with the wire, so smaller shares pay.

uint64_t stripe_chunk(uint64_t chunk, uint64_t total, size_t streams, uint64_t min_stripe) {
  if (streams <= 1 || total >= chunk * streams) return chunk;
  uint64_t share = (total + streams - 1) / streams;
  share = (share + 4095) & ~uint64_t{4095};
  return std::clamp<uint64_t>(share, std::min(min_stripe, chunk), chunk);
}

Status status_from_wire(uint32_t code, std::string message) {
  return Status(static_cast<StatusCode>(code), std::move(message));
}

// --- stage trace (core/stage_trace.h, docs/trace.md) ---

// A response's trace trailer (wire.h TraceTrailerHead + the stamps).
void append_trailer(std::vector<uint8_t>& aux, const TargetStamps& stamps) {
  const TraceTrailerHead head{kTraceTrailerStages, 0};
  const auto* h = reinterpret_cast<const uint8_t*>(&head);
  aux.insert(aux.end(), h, h + sizeof head);
  const auto* v = reinterpret_cast<const uint8_t*>(stamps.data());
  aux.insert(aux.end(), v, v + sizeof(int64_t) * stamps.size());
}

// Sets one stamp in the trailer of a traced response frame (in place: the
// frame's cursor points at its aux, which is not resized).
void put_stamp(TxFrame& f, TraceStage stage, int64_t ns) {
  if (!f.traced) return;
  std::memcpy(f.aux.data() + sizeof(TraceTrailerHead) + sizeof(int64_t) * target_stamp(stage), &ns,
              sizeof ns);
}

TargetStamps stamps_of(const TxFrame& f) {
  TargetStamps st{};
  std::memcpy(st.data(), f.aux.data() + sizeof(TraceTrailerHead), sizeof st);
  return st;
}

// A traced frame starts onto the socket (called just before the sendmsg
// carrying its first byte, so that the peer cannot have received it earlier).
void note_send_start(TxFrame& f) {
  const int64_t now = trace_now_ns();
  if (f.pending) {  // a request of a traced transfer
    if (StageTrace* t = f.pending->transfer->trace.get()) {
      t->mark(TraceStage::kFirstFrameSent, now);
      t->mark(TraceStage::kLastFrameSent, now);
      t->count_frame();
    }
    return;
  }
  put_stamp(f, TraceStage::kResponseSent, now);
}

}  // namespace

// ------------------------------------------------------------------ post ---

namespace {

bool any_gpu(const std::vector<Segment>& segments, bool local) {
  for (const auto& s : segments) {
    if ((local ? s.local_device : s.remote_device) >= 0) return true;
  }
  return false;
}

// Adds the payload pieces to the frame's cursor. GPU pieces are staged in
// `slot`; the returned copies fill it (device→host) or drain it (host→device).
std::vector<DeviceCopy> stage_pieces(IovCursor& cursor, const std::vector<Piece>& pieces,
                                     uint8_t* slot, bool to_host) {
  std::vector<DeviceCopy> copies;
  uint64_t used = 0;
  for (const Piece& p : pieces) {
    if (p.device < 0 || slot == nullptr) {
      cursor.add(p.ptr, p.length);
      continue;
    }
    uint8_t* staged = slot + used;
    used += p.length;
    cursor.add(staged, p.length);
    copies.push_back(to_host ? DeviceCopy{p.device, {staged, p.ptr, p.length}}
                             : DeviceCopy{p.device, {p.ptr, staged, p.length}});
  }
  return copies;
}

// The WRITE now in `s` receives into its pieces: host pieces directly, GPU
// pieces through s.slot (then host-to-device copies, s.h2d).
void stage_write(Stream& s, const std::vector<Piece>& pieces) {
  s.payload.reserve(pieces.size());
  s.h2d = stage_pieces(s.payload, pieces, s.slot ? s.slot->data() : nullptr, false);
}

// A READ_RESPONSE bound for GPU memory receives into `slot`, then copies to
// the device (p.h2d).
void stage_read_response(Pending& p, std::unique_ptr<StagingSlot> slot) {
  p.slot = std::move(slot);
  p.h2d = stage_pieces(p.read_into, p.gpu_pieces, p.slot->data(), false);
}

}  // namespace

Result<TcpTransport::PostPlan> TcpTransport::plan_post(PeerId peer,
                                                       const std::vector<Segment>& segments) {
  PostPlan plan;
  plan.group = primary(peer);
  if (!plan.group || plan.group->dead.load()) {
    return err::PeerDisconnected(fmt::format("no live tcp connection to peer {}", hex_id(peer)));
  }
  plan.local_gpu = any_gpu(segments, true);
  const bool gpu_involved = plan.local_gpu || any_gpu(segments, false);
  if (gpu_involved) {
    if (auto g = gpu(); !g.ok()) return g.status();
  }
  // Frames touching GPU memory on either side fit one staging slot.
  plan.chunk = gpu_involved ? stripe_chunk(std::min<uint64_t>(opt_.chunk_bytes, kGpuFramePayload),
                                           total_bytes(segments), plan.group->streams.size(),
                                           opt_.gpu_min_stripe)
                            : stripe_chunk(opt_.chunk_bytes, total_bytes(segments),
                                           plan.group->streams.size(), kMinStripe);
  return plan;
}

Status TcpTransport::post_write(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                std::vector<Segment> segments) {
  auto planned = plan_post(peer, segments);
  if (!planned.ok()) return planned.status();
  const PostPlan& plan = *planned;
  const bool traced = begin_trace(*transfer, &segments);
  std::vector<std::pair<std::unique_ptr<TxFrame>, std::vector<Piece>>> built;
  std::unique_ptr<TxFrame> f;
  std::vector<Piece> pieces;
  auto open = [&] {
    f = std::make_unique<TxFrame>();
    f->header = make_header(Op::kWrite, transfer->id());
    f->transfer = transfer;
    if (traced) {
      f->header.flags |= kFlagTrace;
      f->traced = true;
    }
    pieces.clear();
  };
  open();
  cut_frames(
      segments, plan.chunk, opt_.max_segments,
      [&](const Segment& seg, uint8_t* local, const WireSegment& w) {
        const auto* b = reinterpret_cast<const uint8_t*>(&w);
        f->aux.insert(f->aux.end(), b, b + sizeof w);
        pieces.push_back({local, w.length, seg.local_device});
        f->header.payload_bytes += w.length;
        ++f->header.count;
      },
      [&] {
        f->header.aux_bytes = static_cast<uint32_t>(f->aux.size());
        f->cursor.reserve(2 + pieces.size());
        f->cursor.add(&f->header, sizeof f->header);
        f->cursor.add(f->aux.data(), f->aux.size());
        f->pending = std::make_shared<Pending>();
        f->pending->expect = Op::kWriteAck;
        f->pending->transfer = transfer;
        f->pending->traced = traced;
        built.emplace_back(std::move(f), pieces);
        open();
      });
  transfer->outstanding.store(built.size());
  if (plan.local_gpu) {
    if (plan.group->held.load(std::memory_order_acquire)) [[unlikely]] {
      HeldPost post{transfer, {}, std::move(built)};
      if (hold(*plan.group, post)) return Status::Ok();
      built = std::move(post.staged);
    }
    post_staged(*plan.group, transfer, std::move(built));
    return Status::Ok();
  }
  std::vector<std::unique_ptr<TxFrame>> frames;
  frames.reserve(built.size());
  for (auto& [frame, frame_pieces] : built) {
    stage_pieces(frame->cursor, frame_pieces, nullptr, true);
    frames.push_back(std::move(frame));
  }
  return enqueue(*plan.group, transfer, std::move(frames));
}

// Frames whose payload is (partly) local GPU memory: each is copied into a
// staging slot as soon as one is free (at once, or on the GPU path's job
// thread when a slot is released), and the completion of its copy puts the
// frame on its stream. Copies of later frames overlap sending earlier ones;
// a write larger than the staging pool flows through it.
void TcpTransport::post_staged(
    Group& group, const std::shared_ptr<Transfer>& transfer,
    std::vector<std::pair<std::unique_ptr<TxFrame>, std::vector<Piece>>> frames) {
  const size_t n = group.streams.size();
  const uint32_t first = group.next_stream.fetch_add(static_cast<uint32_t>(frames.size()));
  GpuPath* path = gpu_.get();
  // Frames with a slot at once: their copies are submitted together
  // (copy_each_then), each frame sent as its own copy finishes.
  std::vector<std::vector<DeviceCopy>> ready_copies;
  std::vector<std::function<void(Status)>> ready_done;
  for (size_t k = 0; k < frames.size(); ++k) {
    auto stream = group.streams[(first + k) % n];
    auto frame = std::make_shared<std::unique_ptr<TxFrame>>(std::move(frames[k].first));
    auto pieces = std::make_shared<std::vector<Piece>>(std::move(frames[k].second));
    // The copy's source is the caller's GPU memory; the frame goes on its
    // stream once the copy is done.
    // The frames of a striped write go out from their streams' I/O threads
    // where those busy-poll (an idle one would wake late), each as soon as
    // its copy is done: sent by the posting thread, the first frame's send
    // (~10 us for 32 KiB on loopback) held back the second's (H100 machine).
    const bool on_worker = frames.size() > 1 && opt_.busy_poll.count() > 0;
    auto copied = [this, transfer, stream, frame, on_worker](Status st) {
      if (StageTrace* t = transfer->trace.get()) t->mark(TraceStage::kStageCopyDone);
      transfer->tx_end();
      if (!st.ok()) {
        fail_transfer(*transfer, st);
      } else if (!(on_worker || GpuPath::on_watcher()
                       ? enqueue_for_worker(*stream, std::move(*frame))
                       : enqueue_on(*stream, std::move(*frame)))) {
        fail_transfer(*transfer, err::PeerDisconnected(fmt::format(
                                     "connection to peer {} is closed", hex_id(transfer->peer()))));
      }
    };
    // Fills the slot's copies; false if the transfer was cancelled.
    auto fill = [transfer, frame, pieces](std::unique_ptr<StagingSlot> slot,
                                          std::vector<DeviceCopy>* copies) {
      {
        // The copy reads the caller's GPU memory: counted under io_mu, so
        // that a cancel() (which sets `cancelled` under it, then waits for
        // the count to drain) either stops this copy here or waits for it.
        // Counted after the check, a copy could start after cancel() had
        // returned.
        std::lock_guard lock(transfer->io_mu);
        if (transfer->cancelled) return false;
        transfer->tx_begin();
      }
      *copies = stage_pieces((*frame)->cursor, *pieces, slot->data(), true);
      (*frame)->slot = std::move(slot);
      if (StageTrace* t = transfer->trace.get()) t->mark(TraceStage::kStageCopySubmitted);
      return true;
    };
    // A slot released later: this frame's copy alone, on the job thread.
    // The write's source: after what the caller queued on the default
    // stream (a PyTorch kernel may still be filling it).
    auto later = [path, fill, copied](std::unique_ptr<StagingSlot> slot) {
      std::vector<DeviceCopy> copies;
      if (fill(std::move(slot), &copies)) {
        path->copy_then(std::move(copies), copied, /*after_default_stream=*/true);
      }
    };
    if (auto slot = path->slot_or_later(later)) {
      std::vector<DeviceCopy> copies;
      if (fill(std::move(slot), &copies)) {
        ready_copies.push_back(std::move(copies));
        ready_done.push_back(std::move(copied));
      }
    }
  }
  if (!ready_copies.empty()) {
    path->copy_each_then(std::move(ready_copies), std::move(ready_done),
                         /*after_default_stream=*/true);
  }
}

Status TcpTransport::post_read(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                               std::vector<Segment> segments) {
  auto planned = plan_post(peer, segments);
  if (!planned.ok()) return planned.status();
  const PostPlan& plan = *planned;
  // Into GPU memory: the landing copies, submitted as the data arrives, run
  // after what the caller queued on the default stream before this call (a
  // memset of the destination), and nothing queued later.
  std::shared_ptr<const DefaultStreamMark> after;
  if (plan.local_gpu) {
    std::vector<int> devices;
    for (const Segment& seg : segments) {
      if (seg.local_device >= 0) devices.push_back(seg.local_device);
    }
    auto mark = DefaultStreamMark::take(devices);
    if (!mark.ok()) return mark.status();
    after = std::move(mark.value());
  }
  const bool traced = begin_trace(*transfer, &segments);
  std::vector<std::unique_ptr<TxFrame>> frames;
  std::unique_ptr<TxFrame> f;
  std::shared_ptr<Pending> p;
  auto open = [&] {
    f = std::make_unique<TxFrame>();
    f->header = make_header(Op::kReadRequest, transfer->id());
    if (traced) {
      f->header.flags |= kFlagTrace;
      f->traced = true;
    }
    p = std::make_shared<Pending>();
    p->expect = Op::kReadResponse;
    p->transfer = transfer;
    p->traced = traced;
    p->after = after;
  };
  open();
  cut_frames(
      segments, plan.chunk, opt_.max_segments,
      [&](const Segment& seg, uint8_t* local, const WireSegment& w) {
        const auto* b = reinterpret_cast<const uint8_t*>(&w);
        f->aux.insert(f->aux.end(), b, b + sizeof w);
        if (plan.local_gpu) {
          p->gpu_pieces.push_back({local, w.length, seg.local_device});
        } else {
          p->read_into.add(local, w.length);
        }
        p->payload_bytes += w.length;
        ++f->header.count;
      },
      [&] {
        f->header.aux_bytes = static_cast<uint32_t>(f->aux.size());
        f->cursor.add(&f->header, sizeof f->header);
        f->cursor.add(f->aux.data(), f->aux.size());
        f->pending = std::move(p);
        frames.push_back(std::move(f));
        open();
      });
  transfer->outstanding.store(frames.size());
  return enqueue(*plan.group, transfer, std::move(frames));
}

Status TcpTransport::post_notification(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                       Bytes payload) {
  if (payload.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes exceeds the limit of {}",
                                            payload.size(), kMaxNotificationBytes));
  }
  auto group = primary(peer);
  if (!group || group->dead.load()) {
    return err::PeerDisconnected(fmt::format("no live tcp connection to peer {}", hex_id(peer)));
  }
  auto f = std::make_unique<TxFrame>();
  f->header = make_header(Op::kNotify, transfer->id());
  // A write's notification is not traced as frames of its own: its round
  // trip shows as response_received -> completed of the write.
  const bool traced = !transfer->trace && begin_trace(*transfer, nullptr);
  if (traced) {
    f->header.flags |= kFlagTrace;
    f->traced = true;
  }
  f->aux = std::move(payload);
  f->header.aux_bytes = static_cast<uint32_t>(f->aux.size());
  f->cursor.add(&f->header, sizeof f->header);
  f->cursor.add(f->aux.data(), f->aux.size());
  f->pending = std::make_shared<Pending>();
  f->pending->expect = Op::kNotifyAck;
  f->pending->transfer = transfer;
  f->pending->traced = traced;
  transfer->outstanding.store(1);
  std::vector<std::unique_ptr<TxFrame>> frames;
  frames.push_back(std::move(f));
  return enqueue(*group, transfer, std::move(frames));
}

Status TcpTransport::enqueue(Group& group, const std::shared_ptr<Transfer>& transfer,
                             std::vector<std::unique_ptr<TxFrame>> frames) {
  if (group.held.load(std::memory_order_acquire)) [[unlikely]] {
    HeldPost post{transfer, std::move(frames), {}};
    if (hold(group, post)) return Status::Ok();
    frames = std::move(post.frames);
  }
  return send_frames(group, std::move(frames));
}

Status TcpTransport::send_frames(Group& group, std::vector<std::unique_ptr<TxFrame>> frames) {
  const size_t n = group.streams.size();
  const uint32_t first = group.next_stream.fetch_add(static_cast<uint32_t>(frames.size()));
  // Frame k goes to stream (first + k) % n; each stream is locked once.
  for (size_t i = 0; i < n && i < frames.size(); ++i) {
    Stream& s = *group.streams[(first + i) % n];
    Status error;
    bool ok;
    {
      std::lock_guard lock(s.tx_mu);
      if (s.dead) {
        return err::PeerDisconnected(
            fmt::format("connection to peer {} is closed", hex_id(group.peer)));
      }
      for (size_t k = i; k < frames.size(); k += n) {
        if (frames[k]->pending) s.pending.push_back(frames[k]->pending);
        s.txq.push_back(std::move(frames[k]));
      }
      ok = flush_locked(s, &error);
    }
    if (!ok) fail_stream(s, error);
  }
  return Status::Ok();
}

bool TcpTransport::enqueue_on(Stream& s, std::unique_ptr<TxFrame> frame) {
  Status error;
  bool ok;
  {
    std::lock_guard lock(s.tx_mu);
    if (s.dead) return false;
    if (frame->pending) s.pending.push_back(frame->pending);
    s.txq.push_back(std::move(frame));
    ok = flush_locked(s, &error);
  }
  if (!ok) fail_stream(s, error);
  return ok;
}

bool TcpTransport::enqueue_for_worker(Stream& s, std::unique_ptr<TxFrame> frame) {
  {
    std::lock_guard lock(s.tx_mu);
    if (s.dead) return false;
    if (frame->pending) s.pending.push_back(frame->pending);
    s.txq.push_back(std::move(frame));
  }
  std::lock_guard g(s.def_mu);  // fail_stream waits on def_mu: the worker is alive
  if (!s.dead) s.worker->request_flush(s.shared_from_this());
  return true;
}

// ------------------------------------------------------------------ send ---

bool TcpTransport::flush_locked(Stream& s, Status* error) {
  {
    // Responses whose GPU copies finished may go, in request order.
    std::lock_guard g(s.def_mu);
    while (!s.deferred.empty() && s.deferred.front()->ready) {
      s.txq.push_back(std::move(s.deferred.front()->frame));
      s.deferred.pop_front();
    }
  }
  iovec iov[kMaxIov];
  while (!s.txq.empty()) {
    TxFrame& f = *s.txq.front();
    if (!f.started) {
      if (f.transfer) {
        std::lock_guard g(f.transfer->io_mu);
        if (f.transfer->cancelled) {
          if (f.pending) f.pending->dropped = true;
          s.txq.pop_front();
          continue;
        }
      }
      f.started = true;
      if (f.transfer) f.transfer->tx_begin();
      if (f.traced) [[unlikely]]
        note_send_start(f);
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(f.cursor.fill(iov, kMaxIov));
    const ssize_t n = ::sendmsg(s.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      *error = err::PeerDisconnected("send failed: " + errno_text(errno));
      return false;
    }
    f.cursor.advance(static_cast<size_t>(n));
    if (f.cursor.done()) {
      if (f.transfer) f.transfer->tx_end();
      s.txq.pop_front();
    }
  }
  s.worker->want_writable(s, !s.txq.empty());
  return true;
}

void TcpTransport::flush(Stream& s) {
  Status error;
  bool ok;
  {
    std::lock_guard lock(s.tx_mu);
    if (s.dead) return;
    ok = flush_locked(s, &error);
  }
  if (!ok) fail_stream(s, error);
}

void TcpTransport::on_writable(Stream& s) {
  flush(s);
}

std::unique_ptr<TxFrame> TcpTransport::make_response(Op op, TransferId id, const Status& status,
                                                     const TargetStamps* stamps) {
  auto f = std::make_unique<TxFrame>();
  f->header = make_header(op, id);
  f->header.status = static_cast<uint32_t>(status.code());
  if (stamps != nullptr) [[unlikely]] {
    f->header.flags |= kFlagTrace;
    f->traced = true;
    append_trailer(f->aux, *stamps);
  }
  if (!status.ok()) {
    const std::string& m = status.message();
    f->aux.insert(f->aux.end(), m.begin(),
                  m.begin() + static_cast<long>(std::min<size_t>(m.size(), kMaxErrorMessage)));
  }
  f->header.aux_bytes = static_cast<uint32_t>(f->aux.size());
  f->cursor.add(&f->header, sizeof f->header);
  f->cursor.add(f->aux.data(), f->aux.size());
  return f;
}

void TcpTransport::send_response(Stream& s, Op op, TransferId id, const Status& status) {
  respond(s, make_response(op, id, status, s.rx_traced ? &s.rx_stamps : nullptr));
}

void TcpTransport::respond(Stream& s, std::unique_ptr<TxFrame> frame) {
  {
    std::lock_guard lock(s.tx_mu);
    if (s.dead) return;
    {
      std::lock_guard g(s.def_mu);
      if (!s.deferred.empty()) {  // behind a GPU copy's response: keep the order
        auto d = std::make_shared<Deferred>();
        d->ready = true;
        d->frame = std::move(frame);
        s.deferred.push_back(std::move(d));
        return;
      }
    }
    if (s.rx_corked.load(std::memory_order_relaxed)) {
      // Inside a receive pass: queue it; the pass ends with one flush for all
      // the responses it produced (one sendmsg instead of one per frame).
      s.txq.push_back(std::move(frame));
      s.cork_pending = true;
      return;
    }
  }
  enqueue_on(s, std::move(frame));
}

std::shared_ptr<Deferred> TcpTransport::defer(Stream& s) {
  // def_mu only: a completion thread may hold tx_mu while it sends megabytes,
  // and the I/O thread calling this should go on receiving meanwhile. Only
  // this stream's I/O thread adds responses, so order needs no more than this.
  auto d = std::make_shared<Deferred>();
  std::lock_guard lock(s.def_mu);
  s.deferred.push_back(d);
  return d;
}

void TcpTransport::complete_deferred(Stream& s, const std::shared_ptr<Deferred>& d,
                                     std::unique_ptr<TxFrame> frame) {
  {
    std::lock_guard g(s.def_mu);
    if (s.dead) return;
    d->frame = std::move(frame);
    d->ready = true;
  }
  // Called from GPU completion threads. Never wait for tx_mu here: its holder
  // may be sending megabytes, and a completion thread stuck behind it delays
  // every other copy's completion (measured: p90 ~1 ms per callback). If the
  // stream is busy, its I/O thread sends the response instead.
  std::unique_lock lock(s.tx_mu, std::try_to_lock);
  if (!lock.owns_lock()) {
    std::lock_guard g(s.def_mu);  // fail_stream waits on def_mu: the worker is alive
    if (!s.dead) s.worker->request_flush(s.shared_from_this());
    return;
  }
  if (s.dead) return;
  Status error;
  const bool ok = flush_locked(s, &error);
  lock.unlock();
  if (!ok) fail_stream(s, error);
}

void TcpTransport::cancel(Transfer& t) {
  {
    std::lock_guard lock(t.io_mu);
    t.cancelled = true;
  }
  // Frames not yet started are dropped by the sender. A frame already partly
  // on the wire must still be finished (the stream is a byte stream), and it
  // reads the caller's memory until then, which may take long if the peer is
  // stalled: copy its unsent rest (at most one chunk per stream) out of the
  // caller's memory instead, so cancel() returns at once.
  std::vector<std::shared_ptr<Group>> groups;
  {
    std::lock_guard lock(mu_);
    for (auto& [key, g] : groups_) {
      if (key.first == t.peer()) groups.push_back(g);
    }
  }
  //
  // The frames of a write already sent are still placed by the target, and
  // those on one stream may be placed after what a later request sends on
  // another: so the frames of the write that are sent but not acknowledged
  // raise the group's cancel fence, and requests posted from now on queue
  // until their WRITE_ACKs are in (or the connection fails).
  const bool fence = t.op() == TransferOp::kWrite;
  for (auto& g : groups) {
    for (auto& sp : g->streams) {
      if (!sp) continue;
      std::lock_guard lock(sp->tx_mu);  // no sender is inside sendmsg now
      if (!sp->txq.empty()) {
        TxFrame& f = *sp->txq.front();
        if (f.started && f.transfer.get() == &t) {
          f.cursor.detach_into(&f.detached);
          f.transfer->tx_end();
          f.transfer.reset();
        }
      }
      if (fence) fence_sent_frames(*g, *sp, t);
    }
  }
  t.wait_tx_idle();  // a sender that was between frames finishes its step
}

// ---------------------------------------------------------- cancel fence ---

bool TcpTransport::hold(Group& group, HeldPost& post) {
  std::lock_guard lock(group.fence_mu);
  if (!group.held.load(std::memory_order_relaxed)) return false;  // lifted meanwhile
  group.backlog.push_back(std::move(post));
  fence_held_requests_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::vector<std::pair<std::string, uint64_t>> TcpTransport::counters() const {
  return {{"fence_held_requests", fence_held_requests_.load(std::memory_order_relaxed)}};
}

void TcpTransport::fence_sent_frames(Group& group, Stream& s, const Transfer& t) {
  // `t.cancelled` is set: its frames not yet started never will be, and get
  // no answer (the sender drops them; marked now so they are not counted).
  for (auto& f : s.txq) {
    if (!f->started && f->transfer.get() == &t && f->pending) f->pending->dropped = true;
  }
  uint64_t sent = 0;
  for (auto& p : s.pending) {
    if (p->transfer.get() == &t && p->expect == Op::kWriteAck && !p->dropped && !p->fenced) {
      p->fenced = true;
      ++sent;
    }
  }
  if (sent == 0) return;
  // Still under tx_mu: their WRITE_ACKs (taken under tx_mu) count down only
  // after this.
  std::lock_guard lock(group.fence_mu);
  group.fenced += sent;
  group.held.store(true, std::memory_order_release);
}

void TcpTransport::unfence(Stream& s) {
  auto group = s.group.lock();
  if (!group) return;
  {
    std::lock_guard lock(group->fence_mu);
    if (group->fenced == 0 || --group->fenced > 0) return;  // 0: lifted by a failure
  }
  release_held(*group);
}

void TcpTransport::release_held(Group& group) {
  // One thread sends at a time, so the backlog leaves in posting order;
  // posts arriving meanwhile queue behind it until `held` is lowered.
  std::unique_lock lock(group.fence_mu);
  if (group.draining) return;
  while (group.fenced == 0) {
    if (group.backlog.empty()) {
      group.held.store(false, std::memory_order_release);
      return;
    }
    HeldPost post = std::move(group.backlog.front());
    group.backlog.pop_front();
    group.draining = true;
    lock.unlock();
    send_held(group, post);
    lock.lock();
    group.draining = false;
  }
  // A new fence went up meanwhile: its last WRITE_ACK sends the rest.
}

void TcpTransport::send_held(Group& group, HeldPost& post) {
  if (group.dead.load()) {
    fail_transfer(*post.transfer, err::PeerDisconnected(fmt::format(
                                      "connection to peer {} is closed", hex_id(group.peer))));
    return;
  }
  if (!post.staged.empty()) {
    post_staged(group, post.transfer, std::move(post.staged));
    return;
  }
  if (Status st = send_frames(group, std::move(post.frames)); !st.ok()) {
    fail_transfer(*post.transfer, st);
  }
}

// ------------------------------------------------------------ revocation ---

void TcpTransport::release_revoked_regions() {
  std::lock_guard lock(mu_);  // shutdown() sets stopped_ under mu_ before dropping workers
  if (stopped_) return;
  for (auto& w : workers_) w->request_release();
}

namespace {
// The first revoked region among `pins`, or null.
Region* first_revoked(const std::vector<RegionPin>& pins) {
  for (const RegionPin& p : pins) {
    if (p.get() != nullptr && p.get()->revoked.load(std::memory_order_acquire)) return p.get();
  }
  return nullptr;
}
}  // namespace

void TcpTransport::release_revoked(Stream& s) {
  // A WRITE arriving into a revoked region: the rest of its payload is read
  // and dropped, and the initiator learns that only a prefix was placed.
  if (s.rx == Stream::Rx::kWaitSlot && !s.reading && s.write_verdict.ok()) {
    // A WRITE waiting for a staging slot: nothing is placed yet; refuse it
    // now, drain its payload once it is read.
    if (Region* r = first_revoked(s.pins)) {
      s.write_verdict = err::NotFound(fmt::format(
          "region {} was deregistered while write {} was arriving: 0 of this frame's {} bytes "
          "were placed, the rest was discarded",
          r->info.id, s.hdr.transfer_id, s.hdr.payload_bytes));
      s.pins.clear();
    }
  }
  if (s.rx == Stream::Rx::kPayload && !s.reading) {
    if (Region* r = first_revoked(s.pins)) {
      const uint64_t left = s.payload.remaining();
      // Into GPU memory the bytes so far are only staged: none reach the region.
      const uint64_t placed = s.slot ? 0 : s.hdr.payload_bytes - left - s.discard_left;
      s.write_verdict = err::NotFound(fmt::format(
          "region {} was deregistered while write {} was arriving: {} of this frame's {} bytes "
          "were placed, the rest was discarded",
          r->info.id, s.hdr.transfer_id, placed, s.hdr.payload_bytes));
      spdlog::info("ferry tcp: {}: {}", peer_name(s), s.write_verdict.message());
      s.discard_left += left;
      s.payload.clear();
      s.h2d.clear();  // GPU target: the staged bytes never reach the device
      s.slot.reset();
      s.pins.clear();
    }
  }
  // READ_RESPONSEs sent from a revoked region: one already on the wire keeps
  // its bytes (copied out now, as of the revocation); one not started yet
  // becomes a NotFound response.
  std::lock_guard lock(s.tx_mu);
  for (auto& f : s.txq) {
    Region* r = first_revoked(f->pins);
    if (r == nullptr) continue;
    if (f->started) {
      if (f->detached.empty()) f->cursor.detach_into(&f->detached);
      f->pins.clear();
      continue;
    }
    const auto op = static_cast<Op>(f->header.op);
    const TransferId id = f->header.transfer_id;
    const TargetStamps stamps = f->traced ? stamps_of(*f) : TargetStamps{};
    f = make_response(op, id,
                      err::NotFound(fmt::format("region {} was deregistered before the {} bytes "
                                                "of read {} were sent",
                                                r->info.id, f->header.payload_bytes, id)),
                      f->traced ? &stamps : nullptr);
  }
}

// ------------------------------------------------------------ completion ---

bool TcpTransport::begin_trace(Transfer& t, const std::vector<Segment>* segments) {
  if (!opt_.trace) return false;
  if (!t.trace) {  // a write's notification reuses the write's trace
    t.trace = std::make_unique<StageTrace>(trace_log_);
    if (segments != nullptr)
      t.trace->set_memory(any_gpu(*segments, true), any_gpu(*segments, false));
  }
  t.trace->mark(TraceStage::kPosted);
  return true;
}

void TcpTransport::absorb_trailer(const Stream& s, const Pending& p, bool payload_follows) {
  StageTrace* trace = p.transfer->trace.get();
  if (!p.traced || trace == nullptr) return;
  if (s.rx_trailer > 0) {
    TraceTrailerHead head;
    std::memcpy(&head, s.aux.data(), sizeof head);
    const size_t n = std::min<size_t>(head.stages, kTraceTrailerStages);
    for (size_t i = 0; i < n; ++i) {
      int64_t ns;
      std::memcpy(&ns, s.aux.data() + sizeof head + sizeof ns * i, sizeof ns);
      if (ns != 0) {
        trace->mark(static_cast<TraceStage>(static_cast<size_t>(TraceStage::kFrameReceived) + i),
                    ns);
      }
    }
  }
  if (!payload_follows) trace->mark(TraceStage::kResponseReceived);
}

void TcpTransport::on_response(const std::shared_ptr<Pending>& p, const Status& status) {
  if (!status.ok()) p->transfer->note_error(status);
  if (p->transfer->outstanding.fetch_sub(1) == 1) finish_unit(p->transfer);
}

void TcpTransport::finish_unit(const std::shared_ptr<Transfer>& t) {
  Status error = t->first_error();
  if (!error.ok()) {
    t->complete(std::move(error));
    return;
  }
  if (t->op() == TransferOp::kWrite && t->has_notification && !t->finished()) {
    // Every frame is acknowledged, so every byte is placed: now the
    // notification may go. Its acknowledgement completes the transfer.
    t->has_notification = false;
    Status s = post_notification(t->peer(), t, std::move(t->notification));
    if (!s.ok()) t->complete(std::move(s));
    return;
  }
  t->complete(Status::Ok());
}

// --------------------------------------------------------------- receive ---

void TcpTransport::on_readable(Stream& s) {
  if (s.dead) {
    close_stream(s);
    return;
  }
  s.rx_corked.store(true, std::memory_order_relaxed);
  receive_pass(s);
  s.rx_corked.store(false, std::memory_order_relaxed);
  if (s.dead) {
    close_stream(s);
    return;
  }
  bool flush_now;
  {
    std::lock_guard lock(s.tx_mu);
    flush_now = s.cork_pending;
    s.cork_pending = false;
  }
  if (flush_now) flush(s);
}

void TcpTransport::receive_pass(Stream& s) {
  int frames = 0;
  for (;;) {
    bool more = false;
    switch (s.rx) {
      case Stream::Rx::kHello:
        more = rx_hello(s);
        break;
      case Stream::Rx::kHelloMetadata:
        more = rx_hello_metadata(s);
        break;
      case Stream::Rx::kHeader:
        more = rx_header(s);
        break;
      case Stream::Rx::kAux:
        more = rx_aux(s);
        break;
      case Stream::Rx::kPayload:
        more = rx_payload(s);
        break;
      case Stream::Rx::kWaitSlot:
        return;
    }
    if (s.dead || !more) return;
    if (s.rx == Stream::Rx::kHeader && s.head_got == 0 && ++frames >= kFramesPerWakeup) return;
  }
}

namespace {
// recv() wrapper: >0 bytes, 0 would block, -1 closed or failed (sets *why).
ssize_t receive(int fd, void* p, size_t n, Status* why) {
  for (;;) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r > 0) return r;
    if (r == 0) {
      *why = err::PeerDisconnected("peer closed the connection");
      return -1;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    *why = err::PeerDisconnected("receive failed: " + errno_text(errno));
    return -1;
  }
}
}  // namespace

namespace {
// A response's error message: its aux after the trace trailer.
std::string response_message(const Stream& s) {
  return std::string(s.aux.begin() + static_cast<long>(s.rx_trailer), s.aux.end());
}
}  // namespace

bool TcpTransport::rx_header(Stream& s) {
  Status why;
  const ssize_t r = receive(s.fd, s.head + s.head_got, sizeof(FrameHeader) - s.head_got, &why);
  if (r < 0) {
    fail_stream(s, why);
    return false;
  }
  if (r == 0) return false;
  s.head_got += static_cast<size_t>(r);
  if (s.head_got < sizeof(FrameHeader)) return true;
  s.head_got = 0;
  std::memcpy(&s.hdr, s.head, sizeof s.hdr);
  if (Status v = validate_header(s.hdr); !v.ok()) {
    hostile_log_.log(spdlog::level::warn,
                     fmt::format("ferry tcp: closing {}: {}", peer_name(s), v.message()));
    fail_stream(s, v);
    return false;
  }
  s.rx_traced = (s.hdr.flags & kFlagTrace) && is_request(static_cast<Op>(s.hdr.op));
  if (s.rx_traced) [[unlikely]] {
    s.rx_stamps = {};
    s.rx_stamps[target_stamp(TraceStage::kFrameReceived)] = trace_now_ns();
  }
  s.aux.resize(s.hdr.aux_bytes);
  s.aux_got = 0;
  s.rx = Stream::Rx::kAux;
  return true;
}

bool TcpTransport::rx_aux(Stream& s) {
  if (s.aux_got < s.aux.size()) {
    Status why;
    const ssize_t r = receive(s.fd, s.aux.data() + s.aux_got, s.aux.size() - s.aux_got, &why);
    if (r < 0) {
      fail_stream(s, why);
      return false;
    }
    if (r == 0) return false;
    s.aux_got += static_cast<size_t>(r);
    if (s.aux_got < s.aux.size()) return true;
  }
  if (Status st = on_frame(s); !st.ok()) {
    hostile_log_.log(spdlog::level::warn,
                     fmt::format("ferry tcp: closing {}: {}", peer_name(s), st.message()));
    fail_stream(s, st);
    return false;
  }
  return true;
}

Status TcpTransport::on_frame(Stream& s) {
  s.rx = Stream::Rx::kHeader;
  if (is_request(static_cast<Op>(s.hdr.op)) && s.group.expired()) {
    return err::ProtocolError("request before the handshake completed");
  }
  s.rx_trailer = 0;
  if (s.hdr.flags & kFlagTrace) [[unlikely]] {
    if (!is_request(static_cast<Op>(s.hdr.op))) {
      auto size = trace_trailer_size(s.hdr, s.aux);
      if (!size.ok()) return size.status();
      s.rx_trailer = *size;
    }
  }
  switch (static_cast<Op>(s.hdr.op)) {
    case Op::kWrite:
      return begin_write(s);
    case Op::kReadRequest:
      return serve_read(s);
    case Op::kNotify: {
      auto g = s.group.lock();
      ctx_.events->on_notification(g->peer, Bytes(s.aux.begin(), s.aux.end()));
      send_response(s, Op::kNotifyAck, s.hdr.transfer_id, Status::Ok());
      return Status::Ok();
    }
    case Op::kReadResponse:
      return begin_read_response(s);
    case Op::kWriteAck:
    case Op::kNotifyAck: {
      std::shared_ptr<Pending> p;
      if (Status st = take_response(s, static_cast<Op>(s.hdr.op), &p, true); !st.ok()) return st;
      absorb_trailer(s, *p, false);
      Status result;
      if (s.hdr.status != 0) {
        result = status_from_wire(
            s.hdr.status,
            fmt::format("{} refused {} of transfer {}: {}", peer_name(s),
                        s.hdr.op == static_cast<uint8_t>(Op::kWriteAck) ? "write" : "notification",
                        s.hdr.transfer_id, response_message(s)));
      }
      on_response(p, result);
      if (p->fenced) [[unlikely]]
        unfence(s);  // set before take_response() found p, under tx_mu
      return Status::Ok();
    }
  }
  return err::ProtocolError(fmt::format("unknown opcode {}", s.hdr.op));
}

// Finds the oldest response this stream expects and checks it is this one.
// A READ_RESPONSE stays listed (pop=false) until its payload is in, so that a
// failing stream fails its transfer too.
Status TcpTransport::take_response(Stream& s, Op expect, std::shared_ptr<Pending>* out, bool pop) {
  std::lock_guard lock(s.tx_mu);
  while (!s.pending.empty() && s.pending.front()->dropped) s.pending.pop_front();
  if (s.pending.empty()) {
    return err::ProtocolError(fmt::format("unexpected {} for transfer {}: nothing outstanding",
                                          op_name(static_cast<uint8_t>(expect)),
                                          s.hdr.transfer_id));
  }
  auto& p = s.pending.front();
  if (p->expect != expect || p->transfer->id() != s.hdr.transfer_id) {
    return err::ProtocolError(fmt::format("got {} for transfer {}, expected {} for transfer {}",
                                          op_name(static_cast<uint8_t>(expect)), s.hdr.transfer_id,
                                          op_name(static_cast<uint8_t>(p->expect)),
                                          p->transfer->id()));
  }
  *out = p;
  if (pop) s.pending.pop_front();
  return Status::Ok();
}

Status TcpTransport::begin_write(Stream& s) {
  std::span<const WireSegment> segs(reinterpret_cast<const WireSegment*>(s.aux.data()),
                                    s.hdr.count);
  uint64_t total = 0;
  if (Status st = check_segments(s.hdr, segs, &total); !st.ok()) return st;
  s.payload.clear();
  s.pins.clear();
  s.slot.reset();
  s.h2d.clear();
  s.discard_left = 0;
  s.write_verdict = Status::Ok();
  std::vector<Piece> pieces;
  pieces.reserve(segs.size());
  bool gpu_target = false;
  for (const WireSegment& w : segs) {
    RegionPin pin;
    auto addr = ctx_.registry->check_remote(
        {w.region_id, w.adv_offset, w.adv_length, w.key, w.access, w.offset, w.length},
        kAccessWrite, &pin);
    if (!addr.ok()) {
      s.write_verdict = addr.status();
      break;
    }
    const MemoryRegion& info = pin.get()->info;
    const int device = info.kind == MemoryKind::kCuda ? info.device : -1;
    gpu_target |= device >= 0;
    pieces.push_back({*addr, w.length, device});
    if (s.pins.empty() || s.pins.back().get() != pin.get()) s.pins.push_back(std::move(pin));
  }
  if (s.write_verdict.ok() && gpu_target) {
    if (total > kGpuFramePayload) {
      return err::ProtocolError(fmt::format("WRITE into GPU memory with a {}-byte frame (limit {})",
                                            total, kGpuFramePayload));
    }
    auto path = gpu();
    if (!path.ok()) {
      s.write_verdict = path.status();
    } else {
      s.slot = (*path)->slot_or_later(resume_with_slot(s));
      if (!s.slot) {  // no slot free: stop reading this stream until one is
        s.wait_pieces = std::move(pieces);
        wait_for_slot(s);
        return Status::Ok();
      }
    }
  }
  if (!s.write_verdict.ok()) {
    // Nothing of a refused frame is written: drain its payload instead.
    s.pins.clear();
    s.slot.reset();
    s.discard_left = total;
  } else {
    stage_write(s, pieces);
  }
  s.rx = Stream::Rx::kPayload;
  return Status::Ok();
}

Status TcpTransport::serve_read(Stream& s) {
  std::span<const WireSegment> segs(reinterpret_cast<const WireSegment*>(s.aux.data()),
                                    s.hdr.count);
  uint64_t total = 0;
  if (Status st = check_segments(s.hdr, segs, &total); !st.ok()) return st;
  const TransferId id = s.hdr.transfer_id;
  auto f = std::make_unique<TxFrame>();
  f->header = make_header(Op::kReadResponse, id);
  f->cursor.reserve(2 + segs.size());
  f->cursor.add(&f->header, sizeof f->header);
  if (s.rx_traced) [[unlikely]] {
    f->header.flags |= kFlagTrace;
    f->traced = true;
    append_trailer(f->aux, s.rx_stamps);
    f->header.aux_bytes = static_cast<uint32_t>(f->aux.size());
    f->cursor.add(f->aux.data(), f->aux.size());
  }
  std::vector<Piece> pieces;
  pieces.reserve(segs.size());
  bool gpu_source = false;
  for (const WireSegment& w : segs) {
    RegionPin pin;
    auto addr = ctx_.registry->check_remote(
        {w.region_id, w.adv_offset, w.adv_length, w.key, w.access, w.offset, w.length}, kAccessRead,
        &pin);
    if (!addr.ok()) {
      send_response(s, Op::kReadResponse, id, addr.status());
      return Status::Ok();
    }
    const MemoryRegion& info = pin.get()->info;
    const int device = info.kind == MemoryKind::kCuda ? info.device : -1;
    gpu_source |= device >= 0;
    pieces.push_back({*addr, w.length, device});
    if (f->pins.empty() || f->pins.back().get() != pin.get()) f->pins.push_back(std::move(pin));
  }
  f->header.payload_bytes = total;
  if (!gpu_source) {
    stage_pieces(f->cursor, pieces, nullptr, true);
    respond(s, std::move(f));
    return Status::Ok();
  }
  // GPU memory: copy it to a staging slot first; the response keeps its
  // place in the stream's answer order meanwhile.
  if (total > kGpuFramePayload) {
    send_response(
        s, Op::kReadResponse, id,
        err::InvalidArgument(fmt::format("READ of GPU memory with a {}-byte frame (limit {})",
                                         total, kGpuFramePayload)));
    return Status::Ok();
  }
  auto path = gpu();
  if (!path.ok()) {
    send_response(s, Op::kReadResponse, id, path.status());
    return Status::Ok();
  }
  // The response keeps its place in the answer order from now on; its copy
  // starts when a staging slot is free (later ones wait in request order).
  auto d = defer(s);
  auto self = s.shared_from_this();
  auto frame = std::make_shared<std::unique_ptr<TxFrame>>(std::move(f));
  auto shared_pieces = std::make_shared<std::vector<Piece>>(std::move(pieces));
  GpuPath* gp = *path;
  auto stage = [this, gp, self, d, frame, shared_pieces, id](std::unique_ptr<StagingSlot> slot) {
    TxFrame& fr = **frame;
    const TargetStamps* stamps = nullptr;
    TargetStamps copied{};
    if (fr.traced) {
      copied = stamps_of(fr);
      stamps = &copied;
    }
    if (Region* r = first_revoked(fr.pins)) {  // deregistered while it waited
      complete_deferred(
          *self, d,
          make_response(Op::kReadResponse, id,
                        err::NotFound(fmt::format("region {} was deregistered before the {} "
                                                  "bytes of read {} were sent",
                                                  r->info.id, fr.header.payload_bytes, id)),
                        stamps));
      return;
    }
    auto copies = stage_pieces(fr.cursor, *shared_pieces, slot->data(), true);
    fr.slot = std::move(slot);
    if (fr.traced) put_stamp(fr, TraceStage::kTargetCopySubmitted, trace_now_ns());
    gp->copy_then(std::move(copies), [this, self, d, frame, id](Status st) {
      TxFrame& done = **frame;
      if (done.traced) put_stamp(done, TraceStage::kTargetCopyDone, trace_now_ns());
      const TargetStamps kept = done.traced ? stamps_of(done) : TargetStamps{};
      complete_deferred(
          *self, d,
          st.ok() ? std::move(*frame)
                  : make_response(Op::kReadResponse, id, st, done.traced ? &kept : nullptr));
    });
  };
  if (auto slot = gp->slot_or_later(stage)) stage(std::move(slot));
  return Status::Ok();
}

Status TcpTransport::begin_read_response(Stream& s) {
  std::shared_ptr<Pending> p;
  const bool ok = s.hdr.status == 0;
  if (Status st = take_response(s, Op::kReadResponse, &p, !ok); !st.ok()) return st;
  absorb_trailer(s, *p, ok);
  if (!ok) {
    on_response(p, status_from_wire(s.hdr.status,
                                    fmt::format("{} refused read of transfer {}: {}", peer_name(s),
                                                s.hdr.transfer_id, response_message(s))));
    return Status::Ok();
  }
  if (s.hdr.payload_bytes != p->payload_bytes) {
    Status bad = err::ProtocolError(
        fmt::format("READ_RESPONSE for transfer {} carries {} bytes, {} were asked",
                    s.hdr.transfer_id, s.hdr.payload_bytes, p->payload_bytes));
    return bad;
  }
  s.discard_left = 0;
  if (!p->gpu_pieces.empty()) {
    // Into GPU memory: receive into a staging slot, copy to the device after.
    auto path = gpu();
    if (!path.ok()) {
      p->transfer->note_error(path.status());
      s.discard_left = p->payload_bytes;
    } else if (auto slot = (*path)->slot_or_later(resume_with_slot(s))) {
      stage_read_response(*p, std::move(slot));
    } else {  // no slot free: stop reading this stream until one is
      s.reading = std::move(p);
      wait_for_slot(s);
      return Status::Ok();
    }
  }
  s.reading = std::move(p);
  s.rx = Stream::Rx::kPayload;
  return Status::Ok();
}

// A frame's payload must land in a staging slot and none is free: the
// stream stops reading (the bytes wait in the socket, and TCP flow control
// holds the peer back) but goes on sending; the I/O thread serves its other
// streams meanwhile. The slot arrives through the worker (resume_receive).
void TcpTransport::wait_for_slot(Stream& s) {
  s.rx = Stream::Rx::kWaitSlot;
  std::lock_guard lock(s.tx_mu);
  s.worker->pause_reading(s, true);
}

std::function<void(std::unique_ptr<StagingSlot>)> TcpTransport::resume_with_slot(Stream& s) {
  std::weak_ptr<Stream> weak = s.shared_from_this();
  return [weak](std::unique_ptr<StagingSlot> slot) {
    auto stream = weak.lock();
    if (!stream) return;
    std::lock_guard g(stream->def_mu);  // fail_stream waits on def_mu: the worker is alive
    if (!stream->dead) stream->worker->request_resume(stream, std::move(slot));
  };
}

void TcpTransport::on_broken_while_waiting(Stream& s) {
  fail_stream(
      s, err::PeerDisconnected("connection failed while a frame waited for a GPU staging slot"));
  close_stream(s);
}

void TcpTransport::resume_receive(Stream& s, std::unique_ptr<StagingSlot> slot) {
  if (s.dead || s.rx != Stream::Rx::kWaitSlot) return;  // the slot goes back
  if (s.reading) {
    stage_read_response(*s.reading, std::move(slot));
  } else if (!s.write_verdict.ok()) {
    // Refused while it waited (its region was deregistered): drain it.
    s.pins.clear();
    s.discard_left = s.hdr.payload_bytes;
  } else {
    s.slot = std::move(slot);
    stage_write(s, s.wait_pieces);
  }
  s.wait_pieces.clear();
  s.rx = Stream::Rx::kPayload;
  {
    std::lock_guard lock(s.tx_mu);
    s.worker->pause_reading(s, false);
  }
  on_readable(s);
}

bool TcpTransport::rx_payload(Stream& s) {
  Status why;
  ssize_t r;
  Transfer* t = s.reading ? s.reading->transfer.get() : nullptr;
  IovCursor& dst = s.reading ? s.reading->read_into : s.payload;
  if (dst.done() && s.discard_left == 0) {
    finish_payload(s);
    return true;
  }
  if (t) {
    // Hold io_mu while bytes land in the caller's memory (see Transfer).
    std::lock_guard lock(t->io_mu);
    if (t->cancelled && !dst.done()) {
      s.discard_left += dst.remaining();
      dst.advance(dst.remaining());
    }
    if (!dst.done()) {
      iovec iov[kMaxIov];
      const int n = dst.fill(iov, kMaxIov);
      r = ::readv(s.fd, iov, n);
    } else {
      r = ::recv(s.fd, s.worker->discard_buffer(),
                 std::min<uint64_t>(s.discard_left, s.worker->discard_size()), 0);
    }
  } else if (!dst.done()) {
    iovec iov[kMaxIov];
    const int n = dst.fill(iov, kMaxIov);
    r = ::readv(s.fd, iov, n);
  } else {
    r = ::recv(s.fd, s.worker->discard_buffer(),
               std::min<uint64_t>(s.discard_left, s.worker->discard_size()), 0);
  }
  if (r == 0) {
    fail_stream(s, err::PeerDisconnected("peer closed the connection"));
    return false;
  }
  if (r < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
    fail_stream(s, err::PeerDisconnected("receive failed: " + errno_text(errno)));
    return false;
  }
  if (!dst.done()) {
    dst.advance(static_cast<size_t>(r));
  } else {
    s.discard_left -= static_cast<uint64_t>(r);
  }
  if (dst.done() && s.discard_left == 0) finish_payload(s);
  return true;
}

void TcpTransport::finish_payload(Stream& s) {
  s.rx = Stream::Rx::kHeader;
  if (s.reading) {
    auto p = std::move(s.reading);
    {
      std::lock_guard lock(s.tx_mu);
      if (!s.pending.empty() && s.pending.front() == p) s.pending.pop_front();
    }
    StageTrace* trace = p->traced ? p->transfer->trace.get() : nullptr;
    if (trace) trace->mark(TraceStage::kResponseReceived);
    if (p->slot) {
      Transfer& t = *p->transfer;
      {
        std::lock_guard lock(t.io_mu);
        if (t.cancelled) {
          p->slot.reset();
          on_response(p, Status::Ok());
          return;
        }
        t.tx_begin();  // the copy writes the caller's GPU memory; cancel waits
      }
      if (trace) trace->mark(TraceStage::kLandCopySubmitted);
      gpu_->copy_then(
          std::move(p->h2d),
          [this, p](Status st) {
            if (StageTrace* tr = p->transfer->trace.get()) tr->mark(TraceStage::kLandCopyDone);
            p->slot.reset();
            p->transfer->tx_end();
            on_response(p, st);
          },
          /*after_default_stream=*/false, p->after);
      return;
    }
    on_response(p, Status::Ok());
    return;
  }
  if (s.rx_traced) s.rx_stamps[target_stamp(TraceStage::kPayloadReceived)] = trace_now_ns();
  if (s.slot) {
    // Placed in the staging slot; acknowledge once it is on the device.
    auto d = defer(s);
    auto keep = std::make_shared<std::pair<std::vector<RegionPin>, std::unique_ptr<StagingSlot>>>(
        std::move(s.pins), std::move(s.slot));
    auto self = s.shared_from_this();
    const TransferId id = s.hdr.transfer_id;
    const bool traced = s.rx_traced;
    TargetStamps stamps = s.rx_stamps;
    if (traced) stamps[target_stamp(TraceStage::kTargetCopySubmitted)] = trace_now_ns();
    gpu_->copy_then(std::move(s.h2d), [this, self, d, keep, id, traced, stamps](Status st) mutable {
      keep->first.clear();
      keep->second.reset();
      if (traced) stamps[target_stamp(TraceStage::kTargetCopyDone)] = trace_now_ns();
      complete_deferred(*self, d, make_response(Op::kWriteAck, id, st, traced ? &stamps : nullptr));
    });
    return;
  }
  s.pins.clear();
  send_response(s, Op::kWriteAck, s.hdr.transfer_id, s.write_verdict);
}

}  // namespace ferry::tcp
