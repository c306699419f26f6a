// cuda_ipc transport: local GPU memory with peer host memory, copied by the
// target -- the initiator exports its GPU allocation (PUSH_EXPORT) and sends
// COPY_REQs; the target maps the export, checks and serves them.
#include <algorithm>
#include <utility>

#include "core/byte_codec.h"
#include "cuda/cuda_detect.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/common/unix_socket.h"
#include "transport/cuda_ipc/cuda_ipc_internal.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"

namespace ferry::cuda_ipc {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

// ------------------------------------ local GPU with peer host memory ---

// Under c.push_mu. Each segment's local GPU range is named as (export id,
// offset): an export already sent on this connection whose allocation is
// still the same (buffer id), else a new PUSH_EXPORT of the registered region.
Status CudaIpcTransport::build_copy_requests(Connection& c, const std::vector<Segment>& segments,
                                             bool write, std::vector<CopyRequest>* out) {
  std::vector<uint64_t> checked;  // export ids whose allocation was verified in this call
  std::vector<int> synced;        // devices whose default stream was waited for
  const Connection::LocalExport* last = nullptr;
  out->clear();
  for (const Segment& s : segments) {
    const auto a = reinterpret_cast<uint64_t>(s.local);
    auto covers = [&](const Connection::LocalExport& e) {
      return a >= e.span_base && a - e.span_base <= e.span_length &&
             s.length <= e.span_length - (a - e.span_base);
    };
    if (last == nullptr || !covers(*last)) {
      last = nullptr;
      for (auto it = c.local_exports.begin(); it != c.local_exports.end(); ++it) {
        if (!covers(*it)) continue;
        if (std::find(checked.begin(), checked.end(), it->id) == checked.end()) {
          // Freed and allocated again since it was exported: export afresh.
          auto info = cuda_pointer_info(reinterpret_cast<const void*>(it->check_address));
          if (!info.ok() || info->buffer_id != it->buffer_id) {
            c.local_exports.erase(it);
            break;
          }
          checked.push_back(it->id);
        }
        last = &*it;
        break;
      }
    }
    if (last == nullptr) {
      auto region = ctx_.registry->find_local(s.local, s.length);
      if (!region.ok()) return region.status();
      auto e = export_memory(region->address, region->length);
      if (!e.ok()) {
        return Status(e.status().code(),
                      fmt::format("cuda_ipc: exporting local GPU memory at {} "
                                  "for peer {}: {}",
                                  region->address, hex_id(c.peer), e.status().message()));
      }
      Connection::LocalExport le;
      le.id = c.next_export_id++;
      le.buffer_id = e->grant.buffer_id;
      le.check_address = e->grant.region_address;
      le.span_base = e->grant.span_base;
      le.span_length = e->grant.span_length;
      // The target drops every older export this one overlaps (see
      // on_push_export); mirror that here so no request names one.
      std::erase_if(c.local_exports, [&](const Connection::LocalExport& o) {
        return o.span_base < le.span_base + le.span_length &&
               le.span_base < o.span_base + o.span_length;
      });
      Status sent;
      {
        std::lock_guard lock(c.send_mu);
        const std::vector<int>& fds = e->fds;
        for (size_t at = 0; at < fds.size() && sent.ok(); at += kMaxFdsPerFrame) {
          const size_t n = std::min<size_t>(kMaxFdsPerFrame, fds.size() - at);
          sent = unix_socket::send_all(c.fd, encode_fds(static_cast<uint32_t>(n)),
                                       std::span<const int>(fds.data() + at, n));
        }
        if (sent.ok()) {
          sent = unix_socket::send_all(c.fd, encode_push_export({le.id, e->grant}));
        }
      }
      if (!sent.ok()) {
        sent = Status(sent.code(), fmt::format("{}: sending PUSH_EXPORT {}: {}", describe(c), le.id,
                                               sent.message()));
        // Part of a frame may be on the wire (see send_frame): the connection
        // cannot go on.
        fail_connection(c, sent);
        return sent;
      }
      c.local_exports.push_back(le);
      last = &c.local_exports.back();
      checked.push_back(le.id);
      if (!covers(*last)) {
        return err::Internal(fmt::format(
            "cuda_ipc: the export of local GPU memory [{:#x}, +{}) does not cover [{:#x}, +{})",
            le.span_base, le.span_length, a, s.length));
      }
    }
    // The peer's copy cannot be ordered after our default stream on the GPU.
    if (opt_.after_default_stream &&
        std::find(synced.begin(), synced.end(), s.local_device) == synced.end()) {
      if (Status st = sync_default_stream(s.local_device); !st.ok()) return st;
      synced.push_back(s.local_device);
    }
    if (out->empty() || out->back().segments.size() == kMaxCopySegments) {
      CopyRequest q;
      q.direction = write ? CopyDirection::kWrite : CopyDirection::kRead;
      out->push_back(std::move(q));
    }
    out->back().segments.push_back({s.remote, last->id, a - last->span_base});
  }
  return Status::Ok();
}

// Under c.push_mu; t->outstanding already counts every request.
void CudaIpcTransport::send_copy_requests(Connection& c, const std::shared_ptr<Transfer>& t,
                                          std::vector<CopyRequest>& requests) {
  for (CopyRequest& q : requests) {
    q.id = next_request_id_.fetch_add(1);
    bool registered = false;
    {
      std::lock_guard lock(c.mu);
      if (!c.dead.load()) {
        c.push_waits.emplace(q.id, t);
        registered = true;
      }
    }
    Status sent = registered ? send_frame(c, encode_copy_request(q))
                             : err::PeerDisconnected(fmt::format("{} is closed", describe(c)));
    if (sent.ok()) continue;
    // Whoever takes the request out of push_waits counts it (here, or
    // fail_connection when the connection died meanwhile).
    bool mine = !registered;
    if (registered) {
      std::lock_guard lock(c.mu);
      mine = c.push_waits.erase(q.id) != 0;
    }
    if (mine) {
      t->note_error(sent);
      if (t->outstanding.fetch_sub(1) == 1) finish_transfer(c, t);
    }
  }
}

Status CudaIpcTransport::on_copy_response(Connection& c, ByteView body) {
  auto a = decode_copy_response(body);
  if (!a.ok()) return a.status();
  std::shared_ptr<Transfer> t;
  {
    std::lock_guard lock(c.mu);
    auto it = c.push_waits.find(a->request_id);
    if (it == c.push_waits.end()) {
      return err::ProtocolError(
          fmt::format("cuda_ipc: COPY_RESP for request {}, which is not waiting", a->request_id));
    }
    t = std::move(it->second);
    c.push_waits.erase(it);
    c.cv.notify_all();
  }
  if (!a->status.ok()) {
    t->note_error(Status(a->status.code(), fmt::format("peer {} refused the copy: {}",
                                                       hex_id(c.peer), a->status.message())));
  }
  if (t->outstanding.fetch_sub(1) == 1) finish_transfer(c, t);
  return Status::Ok();
}

// The initiator's GPU allocation, mapped here. A mapping that fails is kept
// as its error: requests naming it are refused with that reason.
Status CudaIpcTransport::on_push_export(Connection& c, ByteView body) {
  auto e = decode_push_export(body);
  if (!e.ok()) return e.status();
  std::vector<int> fds;
  if (e->grant.kind == HandleKind::kVmm) {
    if (c.announced_fds < e->grant.pieces.size()) {
      return err::ProtocolError(
          fmt::format("cuda_ipc: PUSH_EXPORT of {} VMM pieces, {} descriptors announced",
                      e->grant.pieces.size(), c.announced_fds));
    }
    for (size_t i = 0; i < e->grant.pieces.size(); ++i) {
      fds.push_back(c.rx_fds.front());
      c.rx_fds.pop_front();
    }
    c.announced_fds -= e->grant.pieces.size();
  }
  if (c.peer_exports.count(e->export_id) != 0) {
    for (int d : fds) ::close(d);
    return err::ProtocolError(fmt::format("cuda_ipc: PUSH_EXPORT {} sent twice", e->export_id));
  }
  // An older export overlapping this one is an allocation the initiator freed
  // (live allocations do not overlap): drop it. Copies using it hold their
  // own reference, and the initiator never names it again.
  const uint64_t lo = e->grant.span_base, hi = e->grant.span_base + e->grant.span_length;
  std::erase_if(c.peer_exports, [&](const auto& kv) {
    return kv.second.span_base < hi && lo < kv.second.span_base + kv.second.span_length;
  });
  if (c.peer_exports.size() >= kMaxPieces) {
    for (int d : fds) ::close(d);
    return err::ProtocolError(
        fmt::format("cuda_ipc: {} exports from one peer at once", c.peer_exports.size()));
  }
  Connection::PeerExport pe;
  pe.span_base = e->grant.span_base;
  pe.span_length = e->grant.span_length;
  auto m = Mapping::import(e->grant, std::move(fds), c.pid == ::getpid());
  if (m.ok()) {
    pe.mapping = *m;
  } else {
    pe.error = m.status();
    spdlog::warn("cuda_ipc: {}: cannot map its export {}: {}", describe(c), e->export_id,
                 m.status().message());
  }
  c.peer_exports.emplace(e->export_id, std::move(pe));
  return Status::Ok();
}

// A COPY_REQ: every segment checked as tcp and shm check an operation (region,
// key, range, access); one refusal and nothing moves. Then one CopyStream
// batch per stream, answered from the completion thread.
Status CudaIpcTransport::serve_copy(const std::shared_ptr<Connection>& c, CopyRequest& q) {
  const bool write = q.direction == CopyDirection::kWrite;
  const uint8_t wanted = write ? kAccessWrite : kAccessRead;
  auto sv = std::make_shared<Served>();
  sv->conn = c;
  sv->request_id = q.id;
  sv->has_notification = q.has_notification;
  sv->notification = std::move(q.notification);
  struct Group {
    StreamSlot* slot = nullptr;
    std::vector<CopyBlock> blocks;
  };
  std::vector<Group> groups;
  Status verdict;
  uint64_t host_lo = 0, host_hi = 0;
  bool host_pageable = false;
  const Mapping* last_mapping = nullptr;
  for (size_t i = 0; i < q.segments.size() && verdict.ok(); ++i) {
    const CopySegment& seg = q.segments[i];
    RegionPin pin;
    auto address = ctx_.registry->check_remote(seg.remote, wanted, &pin);
    if (!address.ok()) {
      verdict = Status(address.status().code(),
                       fmt::format("segment {}: {}", i, address.status().message()));
      break;
    }
    if (pin.get()->info.kind != MemoryKind::kHost) {
      verdict = err::InvalidArgument(
          fmt::format("segment {}: region {} is GPU memory; a copy request names host memory", i,
                      seg.remote.region_id));
      break;
    }
    auto pe = c->peer_exports.find(seg.export_id);
    if (pe == c->peer_exports.end() || !pe->second.mapping) {
      verdict =
          pe == c->peer_exports.end()
              ? err::InvalidArgument(fmt::format(
                    "segment {}: export {} of the initiator is unknown here", i, seg.export_id))
              : Status(pe->second.error.code(),
                       fmt::format("segment {}: export {} could not be mapped here: {}", i,
                                   seg.export_id, pe->second.error.message()));
      break;
    }
    const std::shared_ptr<Mapping>& mapping = pe->second.mapping;
    if (seg.export_offset > pe->second.span_length ||
        seg.remote.length > pe->second.span_length - seg.export_offset) {
      verdict = err::OutOfRange(
          fmt::format("segment {}: [{}, +{}) is outside the {} bytes of export {}", i,
                      seg.export_offset, seg.remote.length, pe->second.span_length, seg.export_id));
      break;
    }
    if (sv->pins.empty() || sv->pins.back().get() != pin.get()) sv->pins.push_back(std::move(pin));
    if (mapping.get() != last_mapping) {
      sv->mappings.push_back(mapping);
      last_mapping = mapping.get();
    }
    uint8_t* host = *address;
    uint8_t* gpu = mapping->base() + seg.export_offset;
    uint64_t left = seg.remote.length;
    // Memory on a GPU this process does not see is copied by the GPU that
    // mapped it.
    const int device = mapping->host_copy_device();
    // Host blocks are cut where a page-locked allocation ends (see post());
    // pageable memory goes to the copy engine, which the kernel cannot read.
    while (left > 0) {
      const auto a = reinterpret_cast<uint64_t>(host);
      if (a < host_lo || a >= host_hi) {
        auto info = cuda_pointer_info(host);
        host_pageable = !info.ok() || info->type == CudaMemoryType::kPageableHost;
        const bool ranged = info.ok() && info->size != 0 && !host_pageable;
        host_lo = ranged ? info->base : a;
        host_hi = ranged ? info->base + info->size : a + left;
      }
      const uint64_t piece = std::min(left, host_hi - a);
      const bool engine_only = host_pageable || q.segments.size() <= opt_.engine_max_blocks;
      Group* group = nullptr;
      for (Group& x : groups) {
        if (x.slot->device == device && x.slot->engine_only == engine_only && !x.slot->peer) {
          group = &x;
        }
      }
      if (group == nullptr) {
        auto slot = slot_for(device, engine_only, false);
        if (!slot.ok()) {
          verdict = slot.status();
          break;
        }
        groups.push_back({*slot, {}});
        group = &groups.back();
      }
      const CopyBlock b = write ? CopyBlock{host, gpu, piece} : CopyBlock{gpu, host, piece};
      host += piece;
      gpu += piece;
      left -= piece;
      if (!group->blocks.empty()) {
        CopyBlock& l = group->blocks.back();
        const auto last_host = reinterpret_cast<uint64_t>(write ? l.dst : l.src);
        if (static_cast<uint8_t*>(l.dst) + l.size == b.dst &&
            static_cast<const uint8_t*>(l.src) + l.size == b.src && last_host >= host_lo) {
          l.size += b.size;
          continue;
        }
      }
      group->blocks.push_back(b);
    }
  }
  if (!verdict.ok()) {
    sv->pins.clear();
    return send_frame(*c, encode_copy_response({q.id, verdict}));
  }
  sv->outstanding.store(static_cast<uint32_t>(groups.size()));
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    StreamSlot& slot = *groups[gi].slot;
    std::unique_lock lock(slot.mu);
    auto ticket = slot.stream->submit(groups[gi].blocks, BlockCheck::kClassify);
    if (!ticket.ok()) {
      lock.unlock();
      {
        std::lock_guard elock(sv->mu);
        if (sv->error.ok()) sv->error = ticket.status();
      }
      // This group and the ones after it never run.
      const auto dropped = static_cast<uint32_t>(groups.size() - gi);
      if (sv->outstanding.fetch_sub(dropped) == dropped) finish_served(*sv);
      break;
    }
    slot.fifo.push_back(InFlight{nullptr, c, *ticket, {}, sv});
    in_flight_.fetch_add(1);
  }
  wake_completion();
  return Status::Ok();
}

}  // namespace ferry::cuda_ipc
