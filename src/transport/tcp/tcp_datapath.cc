// tcp transport: the data path. Building frames from segments, posting and
// sending them, responses, completion, cancel and its fence. Receiving is in
// tcp_progress.cc, GPU frames through staging in tcp_staging.cc.
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <climits>

#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/tcp/tcp_internal.h"

namespace ferry::tcp {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

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

// A post's share for one stream from this much payload up is sent by that
// stream's I/O thread (send_frames). Below it, the wake-up would cost more
// than the copy it moves off this thread. A transfer of one frame is always
// sent by the posting thread.
constexpr uint64_t kHandOffBytes = 512 << 10;

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
  const size_t used = std::min(n, frames.size());
  // Frame k goes to stream (first + k) % n; each stream is locked once. A
  // stream whose share carries at least kHandOffBytes of payload is sent by
  // its own I/O thread, woken here, except the first stream's, which this
  // thread sends itself, last: the shares are copied into their sockets in
  // parallel rather than one after the other by this thread.
  for (size_t step = 1; step <= used; ++step) {
    const size_t i = step % used;  // the first stream (i == 0) last
    Stream& s = *group.streams[(first + i) % n];
    uint64_t share = 0;
    for (size_t k = i; k < frames.size(); k += n) share += frames[k]->header.payload_bytes;
    const bool hand_off = i != 0 && share >= kHandOffBytes;
    Status error;
    bool ok = true;
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
      if (!hand_off) ok = flush_locked(s, &error);
    }
    if (!ok) fail_stream(s, error);
    if (hand_off) {
      std::lock_guard g(s.def_mu);  // fail_stream waits on def_mu: the worker is alive
      if (!s.dead) s.worker->request_flush(s.shared_from_this());
    }
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
      drop_unsent_frames(*sp, t);
    }
    // Requests of `t` held behind a cancel fence never go either.
    std::lock_guard fence_lock(g->fence_mu);
    std::erase_if(g->backlog, [&t](const HeldPost& p) { return p.transfer.get() == &t; });
  }
  t.wait_tx_idle();  // a sender that was between frames finishes its step
}

void TcpTransport::drop_unsent_frames(Stream& s, const Transfer& t) {
  // The sender would drop them when it reaches them, but behind a stalled
  // peer it may never do so: a loop of posts and cancels would pile frames
  // (and their expected responses) up without bound.
  // A read's request frames name the transfer only through their Pending
  // (they read no caller memory).
  std::erase_if(s.txq, [&t](const std::unique_ptr<TxFrame>& f) {
    if (f->started) return false;
    if (f->transfer.get() != &t && !(f->pending && f->pending->transfer.get() == &t)) return false;
    if (f->pending) f->pending->dropped = true;
    return true;
  });
  std::erase_if(s.pending, [](const std::shared_ptr<Pending>& p) { return p->dropped; });
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

}  // namespace ferry::tcp
