// tcp transport: the I/O threads (epoll loops, busy polling) and the receive
// path: reading frames, serving requests and taking responses.
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>

#include "core/cpu_relax.h"
#include "core/thread_name.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/tcp/tcp_internal.h"

namespace ferry::tcp {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

constexpr int kFramesPerWakeup = 64;  // fairness between streams of a worker

Status status_from_wire(uint32_t code, std::string message) {
  return Status(static_cast<StatusCode>(code), std::move(message));
}

// The status of a read whose response bytes were dropped because cancel()
// had begun: the same words Engine::cancel() records.
Status cancelled_read(const Transfer& t) {
  return err::Cancelled(fmt::format("transfer {} was cancelled by the caller", t.id()));
}

}  // namespace

// ----------------------------------------------------------------- Worker ---

Worker::Worker(TcpTransport& transport, int index)
    : transport_(transport), index_(index), discard_(64 * 1024) {}

Worker::~Worker() {
  stop();
  if (epfd_ >= 0) ::close(epfd_);
  if (wakefd_ >= 0) ::close(wakefd_);
}

Status Worker::start() {
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  wakefd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || wakefd_ < 0) return err::Internal("epoll/eventfd: " + errno_text(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = &wake_tag_;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, wakefd_, &ev);
  thread_ = std::thread([this] {
    name_this_thread(fmt::format("{}-io-{}", transport_.thread_prefix(), index_));
    run();
  });
  return Status::Ok();
}

void Worker::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  uint64_t one = 1;
  [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
  thread_.join();
  std::lock_guard lock(mu_);
  streams_.clear();
  flush_requests_.clear();
  resume_requests_.clear();
}

void Worker::adopt(const std::shared_ptr<Stream>& stream) {
  stream->worker = this;
  const bool handshaking = stream->handshaking();
  {
    std::lock_guard lock(mu_);
    streams_[stream.get()] = stream;
    // Under mu_, so expire_handshakes() (which recounts under mu_) cannot
    // overwrite this increment with a count taken before the stream arrived.
    if (handshaking) handshaking_.fetch_add(1);
  }
  if (handshaking) {
    // The loop may be asleep with no timeout: wake it to arm the check.
    uint64_t one = 1;
    [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = static_cast<EpollTag*>(stream.get());
  epoll_ctl(epfd_, EPOLL_CTL_ADD, stream->fd, &ev);
}

void Worker::request_flush(std::shared_ptr<Stream> stream) {
  {
    std::lock_guard lock(mu_);
    flush_requests_.push_back(std::move(stream));
  }
  uint64_t one = 1;
  [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
}

void Worker::request_resume(std::shared_ptr<Stream> stream, std::unique_ptr<StagingSlot> slot) {
  {
    std::lock_guard lock(mu_);
    resume_requests_.emplace_back(std::move(stream), std::move(slot));
  }
  uint64_t one = 1;
  [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
}

void Worker::request_release() {
  release_requested_.store(true);
  uint64_t one = 1;
  [[maybe_unused]] auto r = ::write(wakefd_, &one, sizeof one);
}

void Worker::unwatch(int fd) {
  epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
}

void Worker::watch_listener(int fd) {
  listen_fd_ = fd;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = &listen_tag_;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev);
}

void Worker::want_writable(Stream& s, bool on) {
  if (s.want_out == on || s.closed) return;
  s.want_out = on;
  watch_events(s);
}

void Worker::pause_reading(Stream& s, bool paused) {
  if (s.rx_paused == paused || s.closed) return;
  s.rx_paused = paused;
  watch_events(s);
}

void Worker::watch_events(Stream& s) {
  epoll_event ev{};
  ev.events = (s.rx_paused ? 0u : static_cast<uint32_t>(EPOLLIN)) |
              (s.want_out ? static_cast<uint32_t>(EPOLLOUT) : 0u);
  ev.data.ptr = static_cast<EpollTag*>(&s);
  epoll_ctl(epfd_, EPOLL_CTL_MOD, s.fd, &ev);
}

void Worker::run() {
  epoll_event events[64];
  int timeout_ms = -1;
  auto next_handshake_check = std::chrono::steady_clock::time_point{};
  // Polling instead of sleeping (SpinWindow): for busy_poll after any event,
  // and for serve_poll after serving a peer's request, so that the next
  // frame of a round trip finds the thread awake.
  const auto busy_poll = transport_.options().busy_poll;
  const auto serve_poll = transport_.options().serve_poll;
  while (!stop_.load(std::memory_order_relaxed)) {
    const auto round_start = std::chrono::steady_clock::now();
    const bool spinning = spin_.spinning(round_start);
    const int n = epoll_wait(epfd_, events, 64, spinning ? 0 : timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("ferry tcp: epoll_wait failed in worker {}: {}", index_, errno_text(errno));
      return;
    }
    if (n == 0 && spinning && !handshaking_.load(std::memory_order_relaxed)) {
      spin_.idle_round(round_start, std::chrono::steady_clock::now());
      cpu_relax();
      continue;
    }
    if (n > 0 && busy_poll.count() > 0) spin_.arm(std::chrono::steady_clock::now(), busy_poll);
    for (int i = 0; i < n; ++i) {
      auto* tag = static_cast<EpollTag*>(events[i].data.ptr);
      if (tag->kind == EpollTag::kWake) {
        uint64_t v;
        [[maybe_unused]] auto r = ::read(wakefd_, &v, sizeof v);
        continue;
      }
      if (tag->kind == EpollTag::kListener) {
        transport_.on_accept(listen_fd_);
        continue;
      }
      auto* s = static_cast<Stream*>(tag);
      if (s->closed) continue;
      if (events[i].events & EPOLLOUT) transport_.on_writable(*s);
      if (s->rx == Stream::Rx::kWaitSlot) {
        // Reading is paused; a broken connection must not wait for a slot.
        if (events[i].events & (EPOLLERR | EPOLLHUP)) transport_.on_broken_while_waiting(*s);
        continue;
      }
      if (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) transport_.on_readable(*s);
    }
    if (served_request_) {
      served_request_ = false;
      if (serve_poll.count() > 0) spin_.arm(std::chrono::steady_clock::now(), serve_poll);
    }
    std::vector<std::shared_ptr<Stream>> to_flush;
    std::vector<std::pair<std::shared_ptr<Stream>, std::unique_ptr<StagingSlot>>> to_resume;
    {
      std::lock_guard lock(mu_);
      to_flush.swap(flush_requests_);
      to_resume.swap(resume_requests_);
    }
    for (auto& s : to_flush) {
      if (!s->closed) transport_.on_writable(*s);
    }
    for (auto& [s, slot] : to_resume) {
      if (!s->closed) transport_.resume_receive(*s, std::move(slot));
    }
    if (release_requested_.load(std::memory_order_relaxed) && release_requested_.exchange(false)) {
      std::vector<std::shared_ptr<Stream>> all;
      {
        std::lock_guard lock(mu_);
        for (auto& [p, s] : streams_) all.push_back(s);
      }
      for (auto& s : all) {
        if (!s->closed) transport_.release_revoked(*s);
      }
    }
    // The scan runs at most every kHandshakeCheck, not on every wake-up of a
    // busy loop that also has a handshake pending.
    if (!handshaking_.load()) {
      timeout_ms = -1;
    } else {
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_handshake_check) {
        next_handshake_check = now + kHandshakeCheck;
        expire_handshakes();
      }
      timeout_ms = handshaking_.load()
                       ? static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(
                                              next_handshake_check - now)
                                              .count())
                       : -1;
    }
    // Drop closed streams only after the batch: later events may name them.
    std::lock_guard lock(mu_);
    for (auto it = streams_.begin(); it != streams_.end();) {
      it = it->first->closed ? streams_.erase(it) : std::next(it);
    }
  }
}

void Worker::expire_handshakes() {
  const auto now = std::chrono::steady_clock::now();
  std::vector<std::shared_ptr<Stream>> expired;
  uint32_t waiting = 0;
  {
    std::lock_guard lock(mu_);
    for (auto& [raw, s] : streams_) {
      if (s->closed || !s->handshaking()) continue;
      if (now >= s->hello_deadline) {
        expired.push_back(s);
      } else {
        ++waiting;
      }
    }
    handshaking_.store(waiting);
  }
  for (auto& s : expired) transport_.expire_handshake(*s);
  transport_.flush_hostile_log();
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
  const bool request = is_request(static_cast<Op>(s.hdr.op));
  if (request) s.worker->note_request();
  s.rx_traced = (s.hdr.flags & kFlagTrace) && request;
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
      // These bytes will not be placed, so the read must not end Ok: this
      // frame may be its last and complete it before cancel() records
      // Cancelled (a read answered Ok with its buffer partly unwritten).
      t->note_error(cancelled_read(*t));
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
        if (t.cancelled) {  // the bytes stay in the slot: not placed
          p->slot.reset();
          on_response(p, cancelled_read(t));
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
