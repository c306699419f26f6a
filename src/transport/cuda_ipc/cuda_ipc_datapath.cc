// cuda_ipc transport: posting operations on granted regions (the copy
// streams per device), notifications and cancel.
#include <algorithm>

#include "cuda/cuda_detect.h"
#include "fmt/format.h"
#include "fmt/ranges.h"
#include "spdlog/spdlog.h"
#include "transport/cuda_ipc/cuda_ipc_internal.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"

namespace ferry::cuda_ipc {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

Result<CudaIpcTransport::StreamSlot*> CudaIpcTransport::slot_for(int device, bool engine_only,
                                                                 bool peer) {
  std::lock_guard lock(slots_mu_);
  for (auto& s : slots_) {
    if (s->device == device && s->engine_only == engine_only && s->peer == peer) return s.get();
  }
  CopyOptions o;
  o.sm_budget = engine_only ? 0 : opt_.sm_budget;
  o.kernel_max_block = peer ? opt_.peer_kernel_max_block : opt_.kernel_max_block;
  o.use_batch_api = !engine_only && opt_.batch_api;
  o.after_default_stream = opt_.after_default_stream;
  // Within one GPU the resident kernel beats the copy engine to larger blocks.
  o.resident_max_block = peer ? opt_.resident_max_block : opt_.same_gpu_resident_max_block;
  o.resident_linger_us = opt_.resident_linger_us;
  auto stream = CopyStream::create(device, o);
  if (!stream.ok()) return stream.status();
  auto slot = std::make_unique<StreamSlot>();
  slot->device = device;
  slot->engine_only = engine_only;
  slot->peer = peer;
  slot->stream = std::move(*stream);
  slots_.push_back(std::move(slot));
  return slots_.back().get();
}

Status CudaIpcTransport::post(PeerId peer, const std::shared_ptr<Transfer>& t,
                              std::vector<Segment>& segments, bool write) {
  if (trace_log_) {
    t->trace = std::make_unique<StageTrace>(trace_log_);
    bool local_gpu = false, remote_gpu = false;
    for (const Segment& s : segments) {
      local_gpu = local_gpu || s.local_device >= 0;
      remote_gpu = remote_gpu || s.remote_device >= 0;
    }
    t->trace->set_memory(local_gpu, remote_gpu);
    t->trace->mark(TraceStage::kPosted);
  }
  auto c = live_connection(peer);
  if (!c.ok()) return c.status();
  // Peer host memory: the target copies (it cannot be mapped here).
  std::vector<Segment> pushed;
  for (const Segment& s : segments) {
    if (s.remote_device < 0) {
      if (s.local_device < 0) {
        return err::NotSupported(fmt::format(
            "cuda_ipc: region {} of peer {} is host memory and so is the local side; shm or "
            "tcp carries host memory",
            s.remote.region_id, hex_id(peer)));
      }
      pushed.push_back(s);
    }
  }
  if (pushed.empty()) return post_granted(*c, t, segments, write, 0);
  std::unique_lock push_lock((*c)->push_mu);
  std::vector<CopyRequest> requests;
  if (Status s = build_copy_requests(**c, pushed, write, &requests); !s.ok()) return s;
  if (pushed.size() != segments.size()) {
    std::vector<Segment> granted;
    for (const Segment& s : segments) {
      if (s.remote_device >= 0) granted.push_back(s);
    }
    if (Status s = post_granted(*c, t, granted, write, requests.size()); !s.ok()) return s;
  } else {
    t->outstanding.store(requests.size());
    if (write && t->has_notification && requests.size() == 1) {
      // One request: the target delivers the notification after its copy.
      requests[0].has_notification = true;
      requests[0].notification = t->notification;
      t->has_notification = false;
    }
  }
  send_copy_requests(**c, t, requests);
  return Status::Ok();
}

Status CudaIpcTransport::post_granted(const std::shared_ptr<Connection>& conn,
                                      const std::shared_ptr<Transfer>& t,
                                      const std::vector<Segment>& segments, bool write,
                                      uint64_t extra) {
  const std::shared_ptr<Connection>* c = &conn;
  std::vector<ImportedGrant*> grant_of;
  std::vector<std::shared_ptr<ImportedGrant>> used;
  if (Status s = acquire_grants(*c, segments, &grant_of, &used); !s.ok()) return s;

  // Group the blocks by the stream that copies them: the local GPU's, or for
  // local host memory the peer memory's GPU (copy-engine only if pageable).
  struct Group {
    StreamSlot* slot = nullptr;
    std::vector<CopyBlock> blocks;
    // Both sides device memory of the slot's GPU: the copy stream need not
    // ask the driver what the pointers are.
    bool device_only = true;
  };
  std::vector<Group> groups;
  Group* last_group = nullptr;  // reassigned after every push_back below
  uint64_t host_lo = 0, host_hi = 0;
  bool host_pageable = false;
  int peer_from = -1, peer_to = -1;  // the last GPU pair with peer access ensured
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    ImportedGrant* g = grant_of[i];
    uint8_t* remote = g->address + s.remote.offset;
    uint8_t* local = s.local;
    uint64_t left = s.length;
    // A local host block is cut where a page-locked allocation ends: PyTorch's
    // pinned-memory allocator hands out blocks that straddle two
    // registrations, and neither the copy kernel nor cudaMemcpyAsync takes
    // one range across both.
    while (left > 0) {
      int device = s.local_device;
      bool engine_only = segments.size() <= opt_.engine_max_blocks;
      uint64_t piece = left;
      bool local_host = false;
      if (device < 0) {
        local_host = true;
        device = g->mapping->host_copy_device();
        const auto a = reinterpret_cast<uint64_t>(local);
        if (a < host_lo || a >= host_hi) {
          auto info = cuda_pointer_info(local);
          host_pageable = !info.ok() || info->type == CudaMemoryType::kPageableHost;
          const bool ranged = info.ok() && info->size != 0 && !host_pageable;
          host_lo = ranged ? info->base : a;
          host_hi = ranged ? info->base + info->size : a + left;
        }
        piece = std::min(left, host_hi - a);
        // Pageable memory: the copy engine, which takes any host memory; the
        // copy kernel needs pinned, mapped memory.
        engine_only = engine_only || host_pageable;
      } else if (!g->mapping->usable_from(device)) {
        // A legacy IPC handle is open in one GPU's context only, the first
        // that used it; CUDA opens a handle once per process.
        release_grants(**c, used);
        return err::NotSupported(fmt::format(
            "cuda_ipc: peer {}'s region {} was mapped for copies from GPU {}; this call copies "
            "from GPU {} (legacy IPC memory is mapped for one GPU of a process; VMM memory, "
            "e.g. PyTorch's expandable segments, for all)",
            hex_id((*c)->peer), std::get<0>(g->key), g->mapping->host_copy_device(), device));
      } else if (g->mapping->device_visible() && device != g->mapping->device() &&
                 (device != peer_from || g->mapping->device() != peer_to)) {
        // Asked once per pair and call: it takes a process-wide lock.
        peer_from = device;
        peer_to = g->mapping->device();
        if (Status st = ensure_peer_access(device, g->mapping->device()); !st.ok()) {
          release_grants(**c, used);
          return st;
        }
      }
      // Local GPU memory to another GPU's: peer access is enabled (above), so
      // the mapping's address is valid in this GPU's kernels too.
      const bool peer = !local_host && device != g->mapping->device();
      Group* group = last_group;
      if (group == nullptr || group->slot->device != device ||
          group->slot->engine_only != engine_only || group->slot->peer != peer) {
        group = nullptr;
        for (Group& x : groups) {
          if (x.slot->device == device && x.slot->engine_only == engine_only &&
              x.slot->peer == peer) {
            group = &x;
          }
        }
      }
      if (group == nullptr) {
        auto slot = slot_for(device, engine_only, peer);
        if (!slot.ok()) {
          release_grants(**c, used);
          return slot.status();
        }
        groups.push_back({*slot, {}, true});
        group = &groups.back();
      }
      // Device memory on both sides, the peer's with peer access enabled: the
      // copy stream need not ask the driver, and its kernel may take the
      // blocks (asked, it would send peer memory to the copy engine, which
      // pays several microseconds per block).
      group->device_only = group->device_only && s.local_device == device;
      last_group = group;
      const CopyBlock b = write ? CopyBlock{remote, local, piece} : CopyBlock{local, remote, piece};
      local += piece;
      remote += piece;
      left -= piece;
      // Blocks adjacent on both sides (consecutive pages of one tensor) become
      // one copy: the copy engine pays a few microseconds per copy, not per
      // byte. Local host memory only within one allocation (see above).
      if (!group->blocks.empty()) {
        CopyBlock& last = group->blocks.back();
        const auto last_local = reinterpret_cast<uint64_t>(write ? last.src : last.dst);
        if (static_cast<uint8_t*>(last.dst) + last.size == b.dst &&
            static_cast<const uint8_t*>(last.src) + last.size == b.src &&
            (!local_host || last_local >= host_lo)) {
          last.size += b.size;
          continue;
        }
      }
      group->blocks.push_back(b);
    }
  }

  t->outstanding.store(groups.size() + extra);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& group = groups[gi];
    StreamSlot& slot = *group.slot;
    // Every group holds each grant once (released as the group finishes).
    std::vector<std::shared_ptr<ImportedGrant>> held = used;
    if (gi > 0) {
      std::lock_guard lock((*c)->mu);
      for (const auto& g : held) ++g->in_flight;
    }
    std::lock_guard lock(slot.mu);
    auto ticket = slot.stream->submit(
        group.blocks, group.device_only ? BlockCheck::kDeviceMemory : BlockCheck::kClassify);
    if (!ticket.ok()) {
      // Groups already submitted finish on their own and report this error;
      // this one and the ones after it never run (and hold no grants).
      release_grants(**c, held);
      t->note_error(ticket.status());
      if (gi == 0) return ticket.status();
      const uint64_t dropped = groups.size() - gi;
      if (t->outstanding.fetch_sub(dropped) == dropped) finish_transfer(**c, t);
      break;
    }
    slot.fifo.push_back(InFlight{t, *c, *ticket, std::move(held)});
    in_flight_.fetch_add(1);
  }
  if (t->trace) t->trace->mark(TraceStage::kStageCopySubmitted);
  wake_completion();
  return Status::Ok();
}

Status CudaIpcTransport::post_write(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                    std::vector<Segment> segments) {
  return post(peer, transfer, segments, true);
}

Status CudaIpcTransport::post_read(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                   std::vector<Segment> segments) {
  return post(peer, transfer, segments, false);
}

Status CudaIpcTransport::post_notification(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                           Bytes payload) {
  auto c = live_connection(peer);
  if (!c.ok()) return c.status();
  if (payload.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes (at most {})", payload.size(),
                                            kMaxNotificationBytes));
  }
  if (Status s = send_frame(**c, encode_notify(payload)); !s.ok()) return s;
  transfer->complete(Status::Ok());
  return Status::Ok();
}

void CudaIpcTransport::cancel(Transfer& transfer) {
  // A copy on the GPU cannot be called back: wait until it is done, so no
  // byte of it moves after this returns.
  std::vector<std::pair<CopyStream*, uint64_t>> waits;
  {
    std::lock_guard lock(slots_mu_);
    for (auto& s : slots_) {
      std::lock_guard slock(s->mu);
      for (const InFlight& f : s->fifo) {
        if (f.transfer.get() == &transfer) waits.emplace_back(s->stream.get(), f.ticket);
      }
    }
  }
  for (auto& [stream, ticket] : waits) {
    if (Status s = stream->wait(ticket, std::chrono::seconds(60)); !s.ok()) {
      spdlog::warn("cuda_ipc: cancelling transfer {}: {}", transfer.id(), s.message());
    }
  }
  // COPY_REQs run on the peer's GPU, reading or writing our memory: wait for
  // their answers (or the peer's death), at most cuda_ipc.grant_timeout_ms.
  // A peer that has not answered by then may still be copying: give it up
  // (as shm does at shm.cancel_timeout_ms), which fails its other transfers
  // and drops what waited for its answers, rather than return as if nothing
  // could move any more and keep this transfer's requests in push_waits for
  // as long as the peer stalls.
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard lock(mu_);
    for (const auto& c : open_) {
      if (c->peer == transfer.peer()) conns.push_back(c);
    }
  }
  for (auto& c : conns) {
    std::unique_lock lock(c->mu);
    size_t left = 0;
    const bool idle = c->cv.wait_for(lock, opt_.grant_timeout, [&] {
      if (c->dead.load()) return true;
      left = 0;
      for (const auto& [id, t] : c->push_waits) left += t.get() == &transfer ? 1 : 0;
      return left == 0;
    });
    lock.unlock();
    if (!idle) {
      const Status why = err::Timeout(fmt::format(
          "cancel of transfer {} waited {} ms (cuda_ipc.grant_timeout_ms) for {} to answer {} "
          "copy request(s) it may still be running on our memory; the connection is shut down",
          transfer.id(), opt_.grant_timeout.count(), describe(*c), left));
      spdlog::warn("ferry cuda_ipc: {}", why.message());
      fail_connection(*c, why);
    }
  }
  transfer.complete(err::Cancelled(fmt::format("transfer {} cancelled", transfer.id())));
}

}  // namespace ferry::cuda_ipc
