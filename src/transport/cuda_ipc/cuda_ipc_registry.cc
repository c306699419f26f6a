// cuda_ipc transport: grants and their revocation -- serving and requesting
// GRANTs, REVOKE and REVOKE_ACK, the deadlines of revocations.
#include <sys/socket.h>

#include <algorithm>
#include <utility>

#include "core/byte_codec.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/common/unix_socket.h"
#include "transport/cuda_ipc/cuda_ipc_internal.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"

namespace ferry::cuda_ipc {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

GrantKey key_of(const RemoteAccessRequest& r) {
  return {r.region_id, r.adv_offset, r.adv_length, r.key, r.access};
}

}  // namespace

Status CudaIpcTransport::serve_grant(Connection& c, const GrantRequest& q) {
  Grant g;
  g.request_id = q.id;
  RegionPin pin;
  std::optional<ExportedMemory> exported;
  const RemoteAccessRequest req{q.region_id, q.adv_offset, q.adv_length, q.key, q.access,
                                0,           q.adv_length};
  auto address = q.access == 0 ? Result<uint8_t*>(err::PermissionDenied("no access requested"))
                               : ctx_.registry->check_remote(req, q.access, &pin);
  if (!address.ok()) {
    g.status = address.status();
  } else if (pin.get()->info.kind != MemoryKind::kCuda) {
    g.status = err::InvalidArgument(fmt::format(
        "cuda_ipc: region {} is host memory; cuda_ipc maps GPU memory only", q.region_id));
  } else {
    auto e = export_memory(*address, q.adv_length);
    if (!e.ok()) {
      g.status = Status(e.status().code(),
                        fmt::format("region {}: {}", q.region_id, e.status().message()));
    } else {
      exported.emplace(std::move(*e));
      const uint64_t id = g.request_id;
      g = exported->grant;
      g.request_id = id;
      g.status = Status::Ok();
    }
  }
  std::lock_guard lock(c.send_mu);
  if (g.status.ok()) {
    auto [it, fresh] = c.exported.try_emplace(q.region_id);
    if (fresh) it->second.pin = std::move(pin);
    const std::vector<int>& fds = exported->fds;
    for (size_t at = 0; at < fds.size(); at += kMaxFdsPerFrame) {
      const size_t n = std::min<size_t>(kMaxFdsPerFrame, fds.size() - at);
      Bytes f = encode_fds(static_cast<uint32_t>(n));
      if (Status s = unix_socket::send_all(c.fd, f, std::span<const int>(fds.data() + at, n));
          !s.ok()) {
        return s;
      }
    }
  }
  return unix_socket::send_all(c.fd, encode_grant(g));
}

Status CudaIpcTransport::on_grant(Connection& c, ByteView body) {
  auto g = decode_grant(body);
  if (!g.ok()) return g.status();
  std::vector<int> fds;
  if (g->status.ok() && g->kind == HandleKind::kVmm) {
    if (c.announced_fds < g->pieces.size()) {
      return err::ProtocolError(
          fmt::format("cuda_ipc: GRANT of {} VMM pieces, {} descriptors "
                      "announced",
                      g->pieces.size(), c.announced_fds));
    }
    for (size_t i = 0; i < g->pieces.size(); ++i) {
      fds.push_back(c.rx_fds.front());
      c.rx_fds.pop_front();
    }
    c.announced_fds -= g->pieces.size();
  }
  std::lock_guard lock(c.mu);
  auto it = c.grant_waits.find(g->request_id);
  if (it == c.grant_waits.end()) {  // the requester gave up
    for (int d : fds) ::close(d);
    return Status::Ok();
  }
  it->second.done = true;
  it->second.grant = std::move(*g);
  it->second.fds = std::move(fds);
  c.cv.notify_all();
  return Status::Ok();
}

Status CudaIpcTransport::on_revoke(const std::shared_ptr<Connection>& c, ByteView body) {
  auto ids = decode_revoke(body);
  if (!ids.ok()) return ids.status();
  PendingRevoke p{c, *ids, {}};
  {
    std::lock_guard lock(c->mu);
    for (auto it = c->grants.begin(); it != c->grants.end();) {
      if (std::find(ids->begin(), ids->end(), std::get<0>(it->first)) != ids->end()) {
        p.grants.push_back(it->second);
        it = c->grants.erase(it);
      } else {
        ++it;
      }
    }
  }
  // The completion thread answers once no copy uses the grants any more.
  {
    std::lock_guard lock(completion_mu_);
    revokes_.push_back(std::move(p));
  }
  wake_completion();
  return Status::Ok();
}

Status CudaIpcTransport::on_revoke_ack(Connection& c, ByteView body) {
  auto ids = decode_revoke(body);
  if (!ids.ok()) return ids.status();
  std::lock_guard lock(c.send_mu);
  for (uint64_t id : *ids) {
    auto it = c.exported.find(id);
    if (it != c.exported.end() && it->second.revoke_sent) c.exported.erase(it);
  }
  return Status::Ok();
}

Result<std::shared_ptr<ImportedGrant>> CudaIpcTransport::request_grant(
    const std::shared_ptr<Connection>& c, const GrantKey& key, int access_device) {
  GrantRequest q;
  q.id = next_request_id_.fetch_add(1);
  std::tie(q.region_id, q.adv_offset, q.adv_length, q.key, q.access) = key;
  {
    std::lock_guard lock(c->mu);
    c->grant_waits[q.id];
  }
  Status sent = send_frame(*c, encode_grant_request(q));
  Connection::GrantAnswer answer;
  {
    std::unique_lock lock(c->mu);
    const bool got = sent.ok() && c->cv.wait_for(lock, opt_.grant_timeout, [&] {
      return c->grant_waits[q.id].done || c->dead.load();
    });
    answer = std::move(c->grant_waits[q.id]);
    c->grant_waits.erase(q.id);
    if (!sent.ok()) return sent;
    if (!answer.done) {
      for (int d : answer.fds) ::close(d);
      if (c->dead.load()) {
        return err::PeerDisconnected(fmt::format("{} lost while asking for region {}: {}",
                                                 describe(*c), q.region_id, c->dead_reason));
      }
      (void)got;
      return err::Timeout(
          fmt::format("{}: no answer to the grant request for region {} within "
                      "{} ms",
                      describe(*c), q.region_id, opt_.grant_timeout.count()));
    }
  }
  Grant& g = answer.grant;
  if (!g.status.ok()) {
    for (int d : answer.fds) ::close(d);
    return Status(g.status.code(), fmt::format("peer {} refused region {}: {}", hex_id(c->peer),
                                               q.region_id, g.status.message()));
  }
  // One mapping per peer allocation (buffer id), shared by its regions.
  std::shared_ptr<Mapping> mapping;
  {
    std::lock_guard lock(c->mu);
    if (auto it = c->mappings.find(g.buffer_id); it != c->mappings.end() && g.buffer_id != 0) {
      mapping = it->second.lock();
    }
  }
  if (mapping && mapping->length() == g.span_length) {
    for (int d : answer.fds) ::close(d);
  } else {
    Result<std::shared_ptr<Mapping>> m =
        err::NotSupported("the driver refused (injected: cuda_ipc.fault_refuse_import=true)");
    if (opt_.fault_refuse_import) {
      for (int d : answer.fds) ::close(d);
    } else {
      m = Mapping::import(g, std::move(answer.fds), c->pid == ::getpid(), access_device);
    }
    if (!m.ok()) {
      // The driver will not map this peer's memory here (no peer access
      // between the GPUs, IPC not permitted between the containers): from now
      // on this peer's GPU memory goes by the next transport (shm's staging),
      // and this call is posted there again by the engine.
      const std::string why = fmt::format("mapping region {} of peer {}: {}", q.region_id,
                                          hex_id(c->peer), m.status().message());
      bool first = false;
      {
        std::lock_guard lock(c->mu);
        first = c->driver_refused.empty();
        if (first) c->driver_refused = why;
      }
      if (first) refused_peers_.fetch_add(1);
      return err::NotSupported("cuda_ipc: " + why);
    }
    mapping = *m;
    std::lock_guard lock(c->mu);
    c->mappings[g.buffer_id] = mapping;
  }
  auto grant = std::make_shared<ImportedGrant>();
  grant->key = key;
  grant->mapping = mapping;
  grant->address = mapping->base() + (g.region_address - g.span_base);
  grant->length = q.adv_length;
  if (g.region_address - g.span_base > g.span_length ||
      q.adv_length > g.span_length - (g.region_address - g.span_base)) {
    return err::ProtocolError(fmt::format(
        "peer {} granted region {} of {} bytes in a span of {} bytes from offset {}",
        hex_id(c->peer), q.region_id, q.adv_length, g.span_length, g.region_address - g.span_base));
  }
  return grant;
}

Status CudaIpcTransport::acquire_grants(const std::shared_ptr<Connection>& c,
                                        const std::vector<Segment>& segments,
                                        std::vector<ImportedGrant*>* per_segment,
                                        std::vector<std::shared_ptr<ImportedGrant>>* used) {
  per_segment->assign(segments.size(), nullptr);
  for (int round = 0; round < 2; ++round) {
    std::vector<GrantKey> missing;
    std::vector<int> access_device;  // per missing grant: the GPU of its first local block
    {
      std::lock_guard lock(c->mu);
      ImportedGrant* last = nullptr;
      for (size_t i = 0; i < segments.size(); ++i) {
        if ((*per_segment)[i] != nullptr) continue;
        const GrantKey k = key_of(segments[i].remote);
        if (last != nullptr && last->key == k) {
          (*per_segment)[i] = last;
          continue;
        }
        auto it = c->grants.find(k);
        if (it == c->grants.end()) {
          if (std::find(missing.begin(), missing.end(), k) == missing.end()) {
            missing.push_back(k);
            // Local host memory: the process's own GPU, so that its later
            // GPU-memory copies to the same buffer can use the mapping too.
            const int local = segments[i].local_device;
            access_device.push_back(local >= 0 ? local : current_device());
          }
          continue;
        }
        last = it->second.get();
        (*per_segment)[i] = last;
        if (std::find_if(used->begin(), used->end(),
                         [&](const auto& g) { return g.get() == last; }) == used->end()) {
          used->push_back(it->second);
          ++last->in_flight;
        }
      }
    }
    if (missing.empty()) return Status::Ok();
    if (round == 1) break;
    std::lock_guard grant_lock(c->grant_mu);
    for (size_t m = 0; m < missing.size(); ++m) {
      const GrantKey& k = missing[m];
      {
        std::lock_guard lock(c->mu);
        if (c->grants.count(k) != 0) continue;  // another thread got it meanwhile
      }
      auto g = request_grant(c, k, access_device[m]);
      if (!g.ok()) {
        release_grants(*c, *used);
        used->clear();
        return g.status();
      }
      std::lock_guard lock(c->mu);
      c->grants.emplace(k, *g);  // a concurrent request may have won: keep the first
    }
  }
  release_grants(*c, *used);
  used->clear();
  return err::NotFound("cuda_ipc: a region was revoked while its grant was being set up");
}

void CudaIpcTransport::release_grants(Connection& c,
                                      const std::vector<std::shared_ptr<ImportedGrant>>& grants) {
  std::lock_guard lock(c.mu);
  for (const auto& g : grants) --g->in_flight;
}

// Regions this engine granted and has since revoked: ask their importers to
// let go. Called at once and every 10 ms while a deregistration waits.
void CudaIpcTransport::release_revoked_regions() {
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard lock(mu_);
    conns = open_;
  }
  for (auto& c : conns) {
    std::vector<uint64_t> ids;
    std::lock_guard lock(c->send_mu);
    for (auto& [id, e] : c->exported) {
      if (!e.revoke_sent && e.pin.get() != nullptr && e.pin.get()->revoked.load()) {
        e.revoke_sent = true;
        e.revoke_deadline = Clock::now() + opt_.revoke_timeout;
        ids.push_back(id);
      }
    }
    if (ids.empty() || c->dead.load()) continue;
    if (Status s = unix_socket::send_all(c->fd, encode_revoke(Op::kRevoke, ids)); !s.ok()) {
      ::shutdown(c->fd, SHUT_RDWR);  // the I/O thread fails it and drops the pins
    }
  }
  wake_completion();
}

// Answers REVOKEs whose grants no copy uses any more; true while some wait.
bool CudaIpcTransport::process_revokes() {
  std::vector<PendingRevoke> ready;
  bool waiting = false;
  {
    std::lock_guard lock(completion_mu_);
    for (auto it = revokes_.begin(); it != revokes_.end();) {
      bool idle = true;
      {
        std::lock_guard clock(it->conn->mu);
        for (const auto& g : it->grants) idle = idle && g->in_flight == 0;
      }
      if (idle) {
        ready.push_back(std::move(*it));
        it = revokes_.erase(it);
      } else {
        waiting = true;
        ++it;
      }
    }
  }
  for (PendingRevoke& p : ready) {
    p.grants.clear();  // unmaps where this was the last use of the mapping
    if (!p.conn->dead.load()) {
      if (Status s = send_frame(*p.conn, encode_revoke(Op::kRevokeAck, p.region_ids)); !s.ok()) {
        fail_connection(*p.conn, s);
      }
    }
  }
  return waiting;
}

void CudaIpcTransport::enforce_revoke_deadlines() {
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard lock(mu_);
    conns = open_;
  }
  const auto now = Clock::now();
  for (auto& c : conns) {
    RegionId late = 0;
    {
      std::lock_guard lock(c->send_mu);
      for (auto& [id, e] : c->exported) {
        if (e.revoke_sent && now >= e.revoke_deadline) late = id;
      }
    }
    if (late != 0) {
      spdlog::warn(
          "cuda_ipc: {} did not release deregistered region {} within {} ms; closing "
          "the connection",
          describe(*c), late, opt_.revoke_timeout.count());
      fail_connection(*c, err::Timeout(fmt::format(
                              "the peer did not release deregistered region {} within {} ms", late,
                              opt_.revoke_timeout.count())));
    }
  }
}

}  // namespace ferry::cuda_ipc
