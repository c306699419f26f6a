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

constexpr int kMaxIov = 1024;             // IOV_MAX on Linux
constexpr int kFramesPerWakeup = 64;      // fairness between streams of a worker

std::string hex_id(uint64_t id) { return fmt::format("{:016x}", id); }

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
// are chunked. `emit(piece_local, wire_segment)` appends to the open frame;
// `close()` seals it.
template <typename Emit, typename Close>
void cut_frames(const std::vector<Segment>& segments, uint64_t chunk, uint32_t max_segs,
                Emit emit, Close close) {
  uint64_t frame_bytes = 0;
  uint32_t frame_segs = 0;
  for (const Segment& seg : segments) {
    uint64_t done = 0;
    while (done < seg.length) {
      const uint64_t piece = std::min(seg.length - done, chunk - frame_bytes);
      emit(seg.local + done, to_wire(seg.remote, done, piece));
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

Status status_from_wire(uint32_t code, std::string message) {
  return Status(static_cast<StatusCode>(code), std::move(message));
}

}  // namespace

// ------------------------------------------------------------------ post ---

Status TcpTransport::post_write(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                std::vector<Segment> segments) {
  auto group = primary(peer);
  if (!group || group->dead.load()) {
    return err::PeerDisconnected(fmt::format("no live tcp connection to peer {}", hex_id(peer)));
  }
  std::vector<std::unique_ptr<TxFrame>> frames;
  std::unique_ptr<TxFrame> f;
  std::vector<iovec> payload;
  auto open = [&] {
    f = std::make_unique<TxFrame>();
    f->header = make_header(Op::kWrite, transfer->id());
    f->transfer = transfer;
    payload.clear();
  };
  open();
  cut_frames(
      segments, opt_.chunk_bytes, opt_.max_segments,
      [&](uint8_t* local, const WireSegment& w) {
        const auto* b = reinterpret_cast<const uint8_t*>(&w);
        f->aux.insert(f->aux.end(), b, b + sizeof w);
        payload.push_back({local, w.length});
        f->header.payload_bytes += w.length;
        ++f->header.count;
      },
      [&] {
        f->header.aux_bytes = static_cast<uint32_t>(f->aux.size());
        f->cursor.reserve(2 + payload.size());
        f->cursor.add(&f->header, sizeof f->header);
        f->cursor.add(f->aux.data(), f->aux.size());
        for (const auto& p : payload) f->cursor.add(p.iov_base, p.iov_len);
        f->pending = std::make_shared<Pending>();
        f->pending->expect = Op::kWriteAck;
        f->pending->transfer = transfer;
        frames.push_back(std::move(f));
        open();
      });
  transfer->outstanding.store(frames.size());
  return enqueue(*group, std::move(frames));
}

Status TcpTransport::post_read(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                               std::vector<Segment> segments) {
  auto group = primary(peer);
  if (!group || group->dead.load()) {
    return err::PeerDisconnected(fmt::format("no live tcp connection to peer {}", hex_id(peer)));
  }
  std::vector<std::unique_ptr<TxFrame>> frames;
  std::unique_ptr<TxFrame> f;
  std::shared_ptr<Pending> p;
  auto open = [&] {
    f = std::make_unique<TxFrame>();
    f->header = make_header(Op::kReadRequest, transfer->id());
    p = std::make_shared<Pending>();
    p->expect = Op::kReadResponse;
    p->transfer = transfer;
  };
  open();
  cut_frames(
      segments, opt_.chunk_bytes, opt_.max_segments,
      [&](uint8_t* local, const WireSegment& w) {
        const auto* b = reinterpret_cast<const uint8_t*>(&w);
        f->aux.insert(f->aux.end(), b, b + sizeof w);
        p->read_into.add(local, w.length);
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
  return enqueue(*group, std::move(frames));
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
  f->aux = std::move(payload);
  f->header.aux_bytes = static_cast<uint32_t>(f->aux.size());
  f->cursor.add(&f->header, sizeof f->header);
  f->cursor.add(f->aux.data(), f->aux.size());
  f->pending = std::make_shared<Pending>();
  f->pending->expect = Op::kNotifyAck;
  f->pending->transfer = transfer;
  transfer->outstanding.store(1);
  std::vector<std::unique_ptr<TxFrame>> frames;
  frames.push_back(std::move(f));
  return enqueue(*group, std::move(frames));
}

Status TcpTransport::enqueue(Group& group, std::vector<std::unique_ptr<TxFrame>> frames) {
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
        return err::PeerDisconnected(fmt::format("connection to peer {} is closed", hex_id(group.peer)));
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

// ------------------------------------------------------------------ send ---

bool TcpTransport::flush_locked(Stream& s, Status* error) {
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

void TcpTransport::on_writable(Stream& s) { flush(s); }

void TcpTransport::send_response(Stream& s, Op op, TransferId id, const Status& status) {
  auto f = std::make_unique<TxFrame>();
  f->header = make_header(op, id);
  f->header.status = static_cast<uint32_t>(status.code());
  if (!status.ok()) {
    const std::string& m = status.message();
    f->aux.assign(m.begin(), m.begin() + static_cast<long>(std::min<size_t>(m.size(), kMaxErrorMessage)));
  }
  f->header.aux_bytes = static_cast<uint32_t>(f->aux.size());
  f->cursor.add(&f->header, sizeof f->header);
  f->cursor.add(f->aux.data(), f->aux.size());
  enqueue_on(s, std::move(f));
}

void TcpTransport::cancel(Transfer& t) {
  {
    std::lock_guard lock(t.io_mu);
    t.cancelled = true;
  }
  // Frames already partly on the wire read the caller's memory until sent.
  t.wait_tx_idle();
}

// ------------------------------------------------------------ completion ---

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
  int frames = 0;
  for (;;) {
    bool more = false;
    switch (s.rx) {
      case Stream::Rx::kHello: more = rx_hello(s); break;
      case Stream::Rx::kHeader: more = rx_header(s); break;
      case Stream::Rx::kAux: more = rx_aux(s); break;
      case Stream::Rx::kPayload: more = rx_payload(s); break;
    }
    if (s.dead) {
      close_stream(s);
      return;
    }
    if (!more) return;
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
    spdlog::warn("ferry tcp: closing {}: {}", peer_name(s), v.message());
    fail_stream(s, v);
    return false;
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
    spdlog::warn("ferry tcp: closing {}: {}", peer_name(s), st.message());
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
  switch (static_cast<Op>(s.hdr.op)) {
    case Op::kWrite: return begin_write(s);
    case Op::kReadRequest: return serve_read(s);
    case Op::kNotify: {
      auto g = s.group.lock();
      ctx_.events->on_notification(g->peer, Bytes(s.aux.begin(), s.aux.end()));
      send_response(s, Op::kNotifyAck, s.hdr.transfer_id, Status::Ok());
      return Status::Ok();
    }
    case Op::kReadResponse: return begin_read_response(s);
    case Op::kWriteAck:
    case Op::kNotifyAck: {
      std::shared_ptr<Pending> p;
      if (Status st = take_response(s, static_cast<Op>(s.hdr.op), &p, true); !st.ok()) return st;
      Status result;
      if (s.hdr.status != 0) {
        result = status_from_wire(
            s.hdr.status, fmt::format("{} refused {} of transfer {}: {}", peer_name(s),
                                      s.hdr.op == static_cast<uint8_t>(Op::kWriteAck) ? "write" : "notification",
                                      s.hdr.transfer_id, std::string(s.aux.begin(), s.aux.end())));
      }
      on_response(p, result);
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
                                          op_name(static_cast<uint8_t>(expect)), s.hdr.transfer_id));
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
  std::span<const WireSegment> segs(reinterpret_cast<const WireSegment*>(s.aux.data()), s.hdr.count);
  uint64_t total = 0;
  if (Status st = check_segments(s.hdr, segs, &total); !st.ok()) return st;
  s.payload.clear();
  s.pins.clear();
  s.discard_left = 0;
  s.write_verdict = Status::Ok();
  s.payload.reserve(segs.size());
  for (const WireSegment& w : segs) {
    RegionPin pin;
    auto addr = ctx_.registry->check_remote(
        {w.region_id, w.adv_offset, w.adv_length, w.key, w.access, w.offset, w.length},
        kAccessWrite, &pin);
    if (!addr.ok()) {
      // Nothing of a refused frame is written: drain its payload instead.
      s.write_verdict = addr.status();
      s.payload.clear();
      s.pins.clear();
      s.discard_left = total;
      break;
    }
    s.payload.add(*addr, w.length);
    if (s.pins.empty() || s.pins.back().get() != pin.get()) s.pins.push_back(std::move(pin));
  }
  s.rx = Stream::Rx::kPayload;
  return Status::Ok();
}

Status TcpTransport::serve_read(Stream& s) {
  std::span<const WireSegment> segs(reinterpret_cast<const WireSegment*>(s.aux.data()), s.hdr.count);
  uint64_t total = 0;
  if (Status st = check_segments(s.hdr, segs, &total); !st.ok()) return st;
  auto f = std::make_unique<TxFrame>();
  f->header = make_header(Op::kReadResponse, s.hdr.transfer_id);
  f->cursor.reserve(1 + segs.size());
  f->cursor.add(&f->header, sizeof f->header);
  for (const WireSegment& w : segs) {
    RegionPin pin;
    auto addr = ctx_.registry->check_remote(
        {w.region_id, w.adv_offset, w.adv_length, w.key, w.access, w.offset, w.length},
        kAccessRead, &pin);
    if (!addr.ok()) {
      send_response(s, Op::kReadResponse, s.hdr.transfer_id, addr.status());
      return Status::Ok();
    }
    f->cursor.add(*addr, w.length);
    if (f->pins.empty() || f->pins.back().get() != pin.get()) f->pins.push_back(std::move(pin));
  }
  f->header.payload_bytes = total;
  enqueue_on(s, std::move(f));
  return Status::Ok();
}

Status TcpTransport::begin_read_response(Stream& s) {
  std::shared_ptr<Pending> p;
  const bool ok = s.hdr.status == 0;
  if (Status st = take_response(s, Op::kReadResponse, &p, !ok); !st.ok()) return st;
  if (!ok) {
    on_response(p, status_from_wire(s.hdr.status,
                                    fmt::format("{} refused read of transfer {}: {}", peer_name(s),
                                                s.hdr.transfer_id,
                                                std::string(s.aux.begin(), s.aux.end()))));
    return Status::Ok();
  }
  if (s.hdr.payload_bytes != p->payload_bytes) {
    Status bad = err::ProtocolError(fmt::format("READ_RESPONSE for transfer {} carries {} bytes, {} were asked",
                                                s.hdr.transfer_id, s.hdr.payload_bytes, p->payload_bytes));
    return bad;
  }
  s.reading = std::move(p);
  s.discard_left = 0;
  s.rx = Stream::Rx::kPayload;
  return Status::Ok();
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
    on_response(p, Status::Ok());
    return;
  }
  s.pins.clear();
  send_response(s, Op::kWriteAck, s.hdr.transfer_id, s.write_verdict);
}

}  // namespace ferry::tcp
