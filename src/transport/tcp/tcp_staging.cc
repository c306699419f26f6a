// tcp transport: GPU frames through pinned staging slots. Posting frames whose
// payload is local GPU memory, staging received payloads, and waiting for a
// free slot while receiving.
#include <algorithm>

#include "spdlog/spdlog.h"
#include "transport/tcp/tcp_internal.h"

namespace ferry::tcp {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace internal {

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

}  // namespace internal

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

}  // namespace ferry::tcp
