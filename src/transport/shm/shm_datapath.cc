// shm transport, initiator side: posting requests (cut to the limits, staged
// through shared memory or by cross-memory attach), their answers, the
// staging ring's backlog, notifications and cancel.
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <unordered_set>

#include "core/random_bytes.h"
#include "core/thread_name.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/common/unix_socket.h"
#include "transport/shm/shm_gpu_copy.h"
#include "transport/shm/shm_internal.h"
#include "transport/shm/shm_transport.h"

namespace ferry::shm {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

// Calls piece(segment index, offset in it, length) for each piece of the
// requests `segments` are cut into, and close() after each request: at most
// `max_segments` pieces and `max_bytes` bytes per request, large segments cut
// into pieces of the bytes left in the request.
template <typename Piece, typename Close>
void cut_requests(const std::vector<Segment>& segments, uint32_t max_segments, uint64_t max_bytes,
                  Piece&& piece, Close&& close) {
  uint32_t pieces = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const uint64_t length = segments[i].length;
    uint64_t done = 0;
    while (done < length) {
      const uint64_t take = std::min(length - done, max_bytes - bytes);
      piece(i, done, take);
      done += take;
      bytes += take;
      if (++pieces == max_segments || bytes == max_bytes) {
        close();
        pieces = 0;
        bytes = 0;
      }
    }
  }
  if (pieces > 0) close();
}

}  // namespace

Status ShmTransport::on_response(Connection& c, ByteView body) {
  auto response = decode_response(body);
  if (!response.ok()) return response.status();
  return handle_response(c, *response, -1);
}

Status ShmTransport::handle_response(Connection& c, const Response& answer, int ring_slot) {
  const Response* response = &answer;
  Pending p;
  {
    std::lock_guard lock(c.mu);
    if (ring_slot >= 0) {
      const auto slot = static_cast<uint32_t>(ring_slot);
      if (c.ring_ids[slot] != response->id) {
        return err::ProtocolError(fmt::format(
            "request ring slot {} holds an answer to request {}, but request {} was posted there",
            slot, response->id, c.ring_ids[slot]));
      }
      // The slot is ours again (we read the answer out of it already).
      c.ring_ids[slot] = 0;
      c.ring_busy[slot / 64].fetch_and(~(uint64_t{1} << (slot % 64)), std::memory_order_relaxed);
      c.ring_out.state(slot).store(static_cast<uint32_t>(SlotState::kFree),
                                   std::memory_order_release);
      c.ring_unanswered.fetch_sub(1, std::memory_order_relaxed);
    }
    auto it = c.pending.find(response->id);
    if (it == c.pending.end()) {
      return err::ProtocolError(
          fmt::format("RESPONSE for request {}, which is not in flight", response->id));
    }
    if (it->second.on_socket != (ring_slot < 0)) {
      return err::ProtocolError(
          fmt::format("answer to request {} came {}, but the request went {}", response->id,
                      ring_slot < 0 ? "on the socket" : "in the request ring",
                      it->second.on_socket ? "on the socket" : "in the request ring"));
    }
    p = std::move(it->second);
    c.pending.erase(it);
    if (p.on_socket) c.socket_unanswered.fetch_sub(1, std::memory_order_relaxed);
    const std::shared_ptr<Transfer>& t = p.transfer;
    auto f = c.in_flight.find(t.get());
    if (f != c.in_flight.end() && --f->second == 0) {
      c.in_flight.erase(f);
      c.idle_cv.notify_all();  // cancel() may wait for this transfer
    }
  }
  const std::shared_ptr<Transfer>& t = p.transfer;
  if (!response->status.ok()) {
    // The target's message names the region and offset; add who said it.
    t->note_error(Status(response->status.code(),
                         fmt::format("{} (from {})", response->status.message(), describe(c))));
  } else if (!p.copy_out.empty()) {
    uint64_t bytes = 0;
    for (const CopyPiece& piece : p.copy_out) bytes += piece.length;
    if (bytes > opt_.inline_bytes) {
      // Large: a copy thread copies it out, so the I/O thread keeps
      // reading and several answers are copied out at once.
      Task task;
      task.conn = c.shared_from_this();
      task.answered = std::move(p);
      submit(std::move(task));
      return Status::Ok();
    }
    copy_out(*t, c, p);
  }
  finish_answer(c, p);
  return Status::Ok();
}

void ShmTransport::finish_answer(Connection& c, const Pending& p) {
  // Answered (and a read's bytes taken): the target is done with the range.
  if (p.range != kNoRange) release_range(c, p.range);
  if (p.transfer->outstanding.fetch_sub(1) == 1) finish(c.shared_from_this(), p.transfer);
}

void ShmTransport::copy_out(Transfer& t, Connection& c, const Pending& p) {
  // Under io_mu: cancel() (which sets `cancelled` under it first) returns
  // only after a copy that started, and none starts after it.
  std::lock_guard io(t.io_mu);
  if (t.cancelled) return;
  // GPU destinations: host → device copies, waited for here, so the
  // transfer completes only once its bytes are in GPU memory.
  if (Status s = copy_through_area(c, /*own=*/true, p.copy_out, p.copy_out_devices,
                                   /*to_area=*/false, p.after.get());
      !s.ok()) {
    t.note_error(s);
  }
}

void ShmTransport::release_range(Connection& c, uint64_t offset) {
  bool drain = false;
  {
    std::lock_guard lock(c.staging_mu);
    c.ring.release(offset);
    // An answer to a request of a cancelled write: the peer's copy of it is
    // over. The last one lets the backlog go.
    c.fence.erase(offset);
    if (!c.backlog.empty() && !c.draining && c.fence.empty() && !c.dead.load()) {
      c.draining = true;
      drain = true;
    }
  }
  // A copy worker drains: the I/O thread must not copy megabytes or block
  // on a send.
  if (drain) {
    Task task;
    task.conn = c.shared_from_this();
    task.drain = true;
    submit(std::move(task));
  }
}

Status ShmTransport::stage(const std::shared_ptr<Connection>& c, StagedRequest request,
                           uint64_t* budget) {
  uint64_t at = 0;
  bool queued = false;
  bool drain = false;
  {
    std::lock_guard lock(c->staging_mu);
    if (c->dead.load()) {
      return err::PeerDisconnected(fmt::format("shm: connection to {} is closed", describe(*c)));
    }
    std::optional<uint64_t> range;
    if (c->backlog.empty() && c->fence.empty() && request.bytes <= *budget) {
      range = c->ring.allocate(request.bytes);
    }
    if (!range) {
      // The rest of this post queues too (the caller's thread copies one
      // area's worth at most, and requests stay in order).
      *budget = 0;
      c->backlog.push_back(std::move(request));
      queued = true;
      // A release starts the drain while a range is in use (a fenced one
      // among them); else (answers came back meanwhile) nobody would: start
      // it here.
      if (!c->draining && c->fence.empty()) {
        c->draining = true;
        drain = true;
      }
    } else {
      at = *range;
      *budget -= request.bytes;
    }
  }
  if (drain) {
    Task task;
    task.conn = c;
    task.drain = true;
    submit(std::move(task));
  }
  if (queued) return Status::Ok();
  return send_staged(c, request, at);
}

Status ShmTransport::send_staged(const std::shared_ptr<Connection>& c, StagedRequest& request,
                                 uint64_t at) {
  if (request.op == Op::kNotifyReq) {  // held by the cancel fence; no bytes, no range
    const uint64_t id = next_request_id_.fetch_add(1);
    return send_request(c, request.transfer, id,
                        encode_request(Op::kNotifyReq, id, {}, true, request.notification));
  }
  for (WireSegment& w : request.segments) w.address += at;
  for (CopyPiece& p : request.copies) p.remote += at;
  Pending entry;
  entry.range = at;
  entry.bytes = request.bytes;
  std::span<const CopyPiece> copy_in;
  std::span<const int> copy_in_devices;
  if (request.op == Op::kReadReq) {
    entry.copy_out = std::move(request.copies);
    entry.copy_out_devices = std::move(request.devices);
    entry.after = request.after;
  } else {
    copy_in = request.copies;
    copy_in_devices = request.devices;
  }
  const uint64_t id = next_request_id_.fetch_add(1);
  return send_request(c, request.transfer, id,
                      encode_request(request.op, id, request.segments, request.embed_notification,
                                     request.notification, /*staged=*/true),
                      std::move(entry), copy_in, copy_in_devices, request.after.get());
}

void ShmTransport::drain_backlog(const std::shared_ptr<Connection>& c) {
  bool sent_notification = false;
  for (;;) {
    StagedRequest request;
    uint64_t at;
    {
      std::lock_guard lock(c->staging_mu);
      // Only once it is sent may a later notification skip the backlog.
      if (sent_notification) --c->held_notifications;
      sent_notification = false;
      std::optional<uint64_t> range;
      if (!c->dead.load() && !c->backlog.empty() && c->fence.empty()) {
        const StagedRequest& front = c->backlog.front();
        range = front.op == Op::kNotifyReq ? kNoRange : c->ring.allocate(front.bytes);
      }
      if (!range) {
        c->draining = false;  // a later release starts the next drain
        return;
      }
      at = *range;
      request = std::move(c->backlog.front());
      c->backlog.pop_front();
    }
    // A cancelled transfer sends nothing. A failed send fails the
    // connection and with it the transfer -- unless the connection failed
    // just before (it fails only what is pending or queued, and this
    // request is neither): then the transfer fails here.
    Status s = send_staged(c, request, at);
    if (!s.ok() && s.code() != StatusCode::kCancelled) fail_transfer(*request.transfer, s);
    sent_notification = request.op == Op::kNotifyReq;
  }
}

// ------------------------------------------------------ initiator: posts ---

Result<std::shared_ptr<Connection>> ShmTransport::live_connection(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = primary_.find(peer);
  if (it != primary_.end() && !it->second->dead.load()) return it->second;
  if (auto l = lost_.find(peer); l != lost_.end()) {
    return err::PeerDisconnected(
        fmt::format("shm: peer {} is disconnected ({})", hex_id(peer), l->second));
  }
  return err::NotFound(fmt::format("shm: no connection to peer {}", hex_id(peer)));
}

Status ShmTransport::post_write(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                std::vector<Segment> segments) {
  return post(peer, transfer, segments, Op::kWriteReq);
}

Status ShmTransport::post_read(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                               std::vector<Segment> segments) {
  return post(peer, transfer, segments, Op::kReadReq);
}

Status ShmTransport::post(PeerId peer, const std::shared_ptr<Transfer>& t,
                          const std::vector<Segment>& segments, Op op) {
  const char* what = op == Op::kWriteReq ? "write" : "read";
  if (segments.empty()) return err::InvalidArgument(fmt::format("shm: {} with no segments", what));
  auto conn = live_connection(peer);
  if (!conn.ok()) return conn.status();
  // GPU memory on either side goes through the staging areas (the whole
  // call: its host pieces are copied through them too); host memory alone
  // moves as the connection's mode says.
  bool gpu = false;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.local_device < 0 && s.remote_device < 0) continue;
    if (!cuda_here_ || !(*conn)->stages_gpu()) {
      return err::NotSupported(fmt::format(
          "shm: {} segment {} to peer {} names GPU memory (local device {}, remote device {}), "
          "but {}",
          what, i, hex_id(peer), s.local_device, s.remote_device,
          cuda_here_ ? "this connection stages none: " + peer_limits(peer)
                     : std::string("this engine stages no GPU memory (no CUDA device here, or "
                                   "engine.gpu_same_host_path=cuda_ipc|tcp)")));
    }
    gpu = true;
  }
  const bool notify = op == Op::kWriteReq && t->has_notification;
  if (notify && t->notification.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes exceeds the limit of {}",
                                            t->notification.size(), kMaxNotificationBytes));
  }
  const uint32_t max_segments = opt_.max_request_segments;
  const bool staged = (*conn)->staged || gpu;
  uint64_t max_bytes = opt_.max_request_bytes;
  if (staged) {
    // At least four requests in flight fit the area: the copy into it, the
    // target's copies and the copy out of it overlap.
    max_bytes = std::min(max_bytes, std::max(kStagingAlign, (*conn)->own.size() / 4));
  }
  uint64_t requests = 0;
  cut_requests(
      segments, max_segments, max_bytes, [](size_t, uint64_t, uint64_t) {}, [&] { ++requests; });
  // A write that fits one request carries its notification: the target
  // delivers it after the copy. Otherwise it follows the last response.
  const bool embed = notify && requests == 1;
  Bytes note;
  if (embed) {
    note = std::move(t->notification);
    t->has_notification = false;
  }
  // Local GPU memory: its copies (into our area now or later, out of it when
  // a read's answer comes) run after what the caller queued on the default
  // stream before this call -- a cudaMemcpy from pageable memory into the
  // source returns before its DMA is done -- and nothing queued later.
  std::shared_ptr<const DefaultStreamMark> after;
  if (gpu) {
    std::vector<int> local_devices;
    for (const Segment& s : segments) {
      if (s.local_device >= 0) local_devices.push_back(s.local_device);
    }
    if (!local_devices.empty()) {
      auto mark = DefaultStreamMark::take(local_devices);
      if (!mark.ok()) {
        return Status(mark.status().code(), fmt::format("shm: {} to peer {}: {}", what,
                                                        hex_id(peer), mark.status().message()));
      }
      after = std::move(mark.value());
    }
  }
  t->outstanding.store(requests);

  std::vector<WireSegment> current;
  current.reserve(std::min<size_t>(max_segments, segments.size()));
  // Staging: each piece's place in the request's range, and the copies
  // into (write) or out of (read) our area.
  uint64_t staged_bytes = 0;
  std::vector<CopyPiece> copies;
  std::vector<int> devices;  // GPU calls: per copy, its local memory's GPU (-1 host)
  uint64_t direct_budget = staged ? (*conn)->own.size() : 0;  // bytes this thread may copy
  Status result;
  bool stop = false;
  cut_requests(
      segments, max_segments, max_bytes,
      [&](size_t i, uint64_t offset, uint64_t length) {
        if (stop) return;
        const Segment& s = segments[i];
        WireSegment w;
        w.remote = s.remote;
        w.remote.offset += offset;
        w.remote.length = length;
        if (staged) {
          w.address = staged_bytes;  // made absolute once the range is reserved
          copies.push_back({s.local + offset, staged_bytes, length});
          if (gpu) devices.push_back(s.local_device);
          staged_bytes += length;
        } else {
          w.address = reinterpret_cast<uint64_t>(s.local) + offset;
        }
        current.push_back(w);
      },
      [&] {
        if (stop) return;
        Status s;
        if (staged) {
          StagedRequest request;
          request.transfer = t;
          request.op = op;
          request.segments = std::move(current);
          request.copies = std::move(copies);
          request.devices = std::move(devices);
          request.after = after;
          request.bytes = staged_bytes;
          request.embed_notification = embed;
          request.notification = note;
          s = stage(*conn, std::move(request), &direct_budget);
        } else {
          const uint64_t id = next_request_id_.fetch_add(1);
          Pending entry;
          for (const WireSegment& w : current) entry.bytes += w.remote.length;
          s = send_request(*conn, t, id, encode_request(op, id, current, embed, note),
                           std::move(entry));
        }
        current.clear();
        copies.clear();
        devices.clear();
        staged_bytes = 0;
        if (!s.ok()) {
          stop = true;
          // Cancelled: the transfer was cancelled or failed meanwhile; whoever
          // did that completes it.
          if (s.code() != StatusCode::kCancelled) result = s;
        }
      });
  return result;
}

Status ShmTransport::post_notification(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                       Bytes payload) {
  if (payload.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes exceeds the limit of {}",
                                            payload.size(), kMaxNotificationBytes));
  }
  auto conn = live_connection(peer);
  if (!conn.ok()) return conn.status();
  transfer->outstanding.store(1);
  if ((*conn)->stages_gpu() && hold_notification(*conn, transfer, payload)) return Status::Ok();
  const uint64_t id = next_request_id_.fetch_add(1);
  Status s =
      send_request(*conn, transfer, id, encode_request(Op::kNotifyReq, id, {}, true, payload));
  return s.code() == StatusCode::kCancelled ? Status::Ok() : s;
}

bool ShmTransport::hold_notification(const std::shared_ptr<Connection>& c,
                                     const std::shared_ptr<Transfer>& t, Bytes& payload) {
  bool drain = false;
  {
    std::lock_guard lock(c->staging_mu);
    if ((c->fence.empty() && c->held_notifications == 0) || c->dead.load()) return false;
    StagedRequest request;
    request.transfer = t;
    request.op = Op::kNotifyReq;
    request.embed_notification = true;
    request.notification = std::move(payload);
    c->backlog.push_back(std::move(request));
    ++c->held_notifications;
    // The fence's last release drains; with the fence down, a drain is
    // sending the held ones already, or is started here.
    if (!c->draining && c->fence.empty()) {
      c->draining = true;
      drain = true;
    }
  }
  if (drain) {
    Task task;
    task.conn = c;
    task.drain = true;
    submit(std::move(task));
  }
  return true;
}

Status ShmTransport::send_request(const std::shared_ptr<Connection>& c,
                                  const std::shared_ptr<Transfer>& t, uint64_t id,
                                  const Bytes& frame, Pending entry,
                                  std::span<const CopyPiece> copy_in,
                                  std::span<const int> copy_in_devices,
                                  const DefaultStreamMark* after) {
  const uint64_t range = entry.range;
  Status refused;
  bool copy_failed = false;
  bool in_ring = false;
  {
    // Under io_mu: cancel() either sees this request in in_flight and waits
    // for its answer, or we see `cancelled` and send nothing.
    std::lock_guard io(t->io_mu);
    if (t->cancelled) {
      refused = err::Cancelled("");
    } else {
      // A staged write's bytes go into our area before the peer can see
      // the request; cancel() waits for this copy out of local memory (GPU
      // memory: device → host copies, waited for here).
      refused =
          copy_through_area(*c, /*own=*/true, copy_in, copy_in_devices, /*to_area=*/true, after);
      copy_failed = !refused.ok();
      std::lock_guard lock(c->mu);
      if (copy_failed) {
        // nothing sent
      } else if (c->dead.load()) {
        refused =
            err::PeerDisconnected(fmt::format("shm: connection to {} is closed", describe(*c)));
      } else {
        entry.transfer = t;
        // Small ones through the request ring where it may take them
        // (GPU memory's staged requests too: their copies run as over the socket).
        in_ring = c->rings && ring_post_locked(*c, id, frame, entry);
        if (!in_ring) {
          entry.on_socket = true;
          c->socket_unanswered.fetch_add(1, std::memory_order_relaxed);
        }
        c->pending.emplace(id, std::move(entry));
        ++c->in_flight[t.get()];
      }
    }
  }
  if (!refused.ok()) {
    if (range != kNoRange) release_range(*c, range);
    // Requests of the transfer already sent are still answered: the
    // transfer fails now, and their answers find it failed.
    if (copy_failed) fail_transfer(*t, refused);
    return refused;
  }
  if (in_ring) {
    ring_wake_peer(*c);
    return Status::Ok();
  }
  Status s = send_frame(*c, frame);
  if (!s.ok()) fail_connection(*c, s);  // fails `t` with the others in flight
  return s;
}

void ShmTransport::finish(const std::shared_ptr<Connection>& c,
                          const std::shared_ptr<Transfer>& t) {
  {
    std::lock_guard io(t->io_mu);
    if (t->cancelled) return;  // cancel() or a failure completes it
  }
  Status error = t->first_error();
  if (!error.ok()) {
    t->complete(std::move(error));
    return;
  }
  if (t->op() == TransferOp::kWrite && t->has_notification) {
    // Every request is answered, so every byte is placed: the notification
    // may go now. The I/O thread never sends (it must keep reading), so a
    // copy worker does; its answer completes the transfer.
    t->has_notification = false;
    submit(Task{c, Request{}, t});
    return;
  }
  t->complete(Status::Ok());
}

void ShmTransport::send_write_notification(const std::shared_ptr<Connection>& c,
                                           const std::shared_ptr<Transfer>& t) {
  t->outstanding.store(1);
  const uint64_t id = next_request_id_.fetch_add(1);
  Status s = send_request(c, t, id, encode_request(Op::kNotifyReq, id, {}, true, t->notification));
  if (!s.ok() && s.code() != StatusCode::kCancelled) fail_transfer(*t, s);
}

void ShmTransport::cancel(Transfer& t) {
  {
    std::lock_guard io(t.io_mu);
    t.cancelled = true;  // requests not yet sent are dropped
  }
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard lock(mu_);
    for (auto& c : open_) {
      if (c->peer == t.peer()) conns.push_back(c);
    }
  }
  // The peer copies into or out of our memory until it answers. Tell it to
  // skip what it has not started, then (cross-memory attach) wait for every
  // request already sent, bounded by shm.cancel_timeout_ms.
  const bool write = t.op() == TransferOp::kWrite;
  for (auto& c : conns) {
    std::vector<uint64_t> ids;
    {
      // Staged requests not sent yet never will be: drop them (and with
      // them the pointers into the caller's memory).
      std::lock_guard staging(c->staging_mu);
      std::erase_if(c->backlog, [&](const StagedRequest& r) {
        if (r.transfer.get() != &t) return false;
        if (r.op == Op::kNotifyReq) --c->held_notifications;
        return true;
      });
      // Under staging_mu too: an answer that arrives now gives its range
      // back only after the range joined the fence.
      std::lock_guard lock(c->mu);
      for (const auto& [id, p] : c->pending) {
        if (p.transfer.get() != &t) continue;
        ids.push_back(id);
        // Staging: the peer may be copying this request's bytes from its
        // area into its region right now, and will until it answers. Later
        // requests wait for that answer (Connection::fence).
        if (write && p.range != kNoRange) c->fence.insert(p.range);
      }
    }
    for (size_t at = 0; at < ids.size(); at += kMaxCancelIds) {
      const size_t n = std::min<size_t>(kMaxCancelIds, ids.size() - at);
      if (!send_frame(*c, encode_cancel(std::span(ids).subspan(at, n))).ok()) break;
    }
  }
  const auto deadline = Clock::now() + opt_.cancel_timeout;
  for (auto& c : conns) {
    // Staging: the peer copies only into and out of our area, never into
    // the caller's memory; our own copies check `cancelled` under io_mu. So
    // nothing to wait for, and a stalled peer keeps its connection: its late
    // answers give the ranges back, and lift the fence that holds later
    // requests back until the cancelled write's copies on the peer are over.
    if (c->staged) continue;
    std::unique_lock lock(c->mu);
    const bool idle = c->idle_cv.wait_until(
        lock, deadline, [&] { return c->dead.load() || c->in_flight.count(&t) == 0; });
    if (idle) continue;
    const uint32_t left = c->in_flight[&t];
    lock.unlock();
    const Status why = err::Timeout(fmt::format(
        "cancel of transfer {} waited {} ms (shm.cancel_timeout_ms) for {} to answer {} "
        "request(s) it may still be copying; the connection is shut down",
        t.id(), opt_.cancel_timeout.count(), describe(*c), left));
    spdlog::warn("ferry shm: {}", why.message());
    fail_connection(*c, why);
  }
}

}  // namespace ferry::shm
