#include <dlfcn.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>

#include "core/block_cache.h"
#include "core/byte_codec.h"
#include "core/cpu_relax.h"
#include "core/thread_name.h"
#include "core/version.h"
#include "ferry/gpu.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/fabric/fabric_internal.h"
#include "transport/fabric/fabric_transport.h"

namespace ferry::fabric {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

// The key this thread got last from a peer's grants (FabricTransport::grant_for).
struct GrantCache {
  std::shared_ptr<Peer> peer;  // held: its address is not reused while cached
  uint64_t revoke_gen = 0;
  GrantKey key;
  RemoteKey value;
};
thread_local GrantCache t_grant_cache;

}  // namespace

// --- keys ---------------------------------------------------------------------

Result<RemoteKey> FabricTransport::grant_for(const std::shared_ptr<Peer>& p,
                                             const RemoteAccessRequest& r, uint64_t revoke_gen) {
  const GrantKey key = key_of(r);
  // Calls on one descriptor, one after another, find its key without p->mu.
  // An entry is good while no REVOKE came (revoke_gen as read before this
  // lookup): a grant is dropped only by a REVOKE, which raises it, or with
  // the peer's death, which post() checks under post_mu_ anyway.
  GrantCache& c = *detail::tls_address(t_grant_cache);
  if (c.peer == p && c.revoke_gen == revoke_gen && c.key == key) return c.value;
  auto remember = [&](const RemoteKey& k) {
    if (c.peer != p) c.peer = p;
    c.revoke_gen = revoke_gen;
    c.key = key;
    c.value = k;
    return k;
  };
  std::unique_lock lock(p->mu);
  if (auto it = p->grants.find(key); it != p->grants.end()) return remember(it->second);
  const uint64_t request = next_request_.fetch_add(1);
  p->grant_waits[request] = {};
  lock.unlock();
  GrantReq q{r.region_id, r.adv_offset, r.adv_length, r.key, r.access};
  if (Status s = send(p, p->addr, MsgType::kGrantReq, request, encode_grant_req(q)); !s.ok()) {
    lock.lock();
    p->grant_waits.erase(request);
    return s;
  }
  lock.lock();
  const bool answered = p->cv.wait_for(
      lock, opt_.grant_timeout, [&] { return p->grant_waits[request].done || p->dead.load(); });
  Peer::GrantWait w = p->grant_waits[request];
  p->grant_waits.erase(request);
  if (!w.done) {
    if (p->dead.load()) {
      return err::PeerDisconnected(fmt::format("fabric: {}: {}", describe(*p), p->dead_reason));
    }
    (void)answered;
    return err::Timeout(
        fmt::format("fabric: {} did not answer the key request for region {} "
                    "within {} ms",
                    describe(*p), r.region_id, opt_.grant_timeout.count()));
  }
  if (!w.grant.status.ok()) return w.grant.status;
  RemoteKey k{w.grant.mr_key, w.grant.base};
  p->grants[key] = k;
  p->revoked.erase(r.region_id);
  return remember(k);
}

Result<void*> FabricTransport::local_desc(const Segment& s) {
  auto region = ctx_.registry->find_local(s.local, s.length);
  if (!region.ok()) return region.status();
  std::lock_guard lock(export_mu_);
  auto it = local_mrs_.find(region->id);
  if (it == local_mrs_.end()) {
    LocalMr l;
    l.region = ctx_.registry->find(region->id);
    if (!l.region) return err::NotFound(fmt::format("local region {} is gone", region->id));
    const int device = region->kind == MemoryKind::kCuda ? region->device : -1;
    int r = register_mr(region->address, region->length, FI_READ | FI_WRITE, device, &l.mr);
    if (r != 0) {
      return err::Internal(fmt::format("fabric: registering local region {} ({}): {}", region->id,
                                       device >= 0 ? "GPU memory, FI_HMEM" : "host", fi_error(r)));
    }
    it = local_mrs_.emplace(region->id, std::move(l)).first;
  }
  return fi_mr_desc(it->second.mr);
}

int FabricTransport::register_mr(void* address, size_t length, uint64_t access, int device,
                                 struct fid_mr** mr) {
  int ret;
  if (device >= 0) {
    struct iovec iov {
      address, length
    };
    struct fi_mr_attr attr {};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = next_key_.fetch_add(1);
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = device;
    ret = fi_mr_regattr(domain_, &attr, 0, mr);
  } else {
    ret = fi_mr_reg(domain_, address, length, access, 0, next_key_.fetch_add(1), 0, mr, nullptr);
  }
  if (ret == 0 && (mr_mode_ & FI_MR_ENDPOINT)) {
    ret = fi_mr_bind(*mr, &ep_->fid, 0);
    if (ret == 0) ret = fi_mr_enable(*mr);
  }
  if (ret != 0 && *mr) {
    fi_close(&(*mr)->fid);
    *mr = nullptr;
  }
  return ret;
}

Status FabricTransport::serve_grant(const std::shared_ptr<Peer>& p, uint64_t request,
                                    const GrantReq& q) {
  Grant g;
  RemoteAccessRequest r;
  r.region_id = q.region;
  r.adv_offset = q.adv_offset;
  r.adv_length = q.adv_length;
  r.key = q.key;
  r.access = q.access;
  r.offset = 0;
  r.length = q.adv_length;
  RegionPin pin;
  auto addr = ctx_.registry->check_remote(r, q.access, &pin);
  if (!addr.ok()) {
    g.status = addr.status();
  } else if (pin.get()->info.kind != MemoryKind::kHost && !hmem_) {
    g.status = err::NotSupported(
        fmt::format("region {} is GPU memory, which this engine's fabric transport cannot expose "
                    "without FI_HMEM (provider {}); tcp carries it",
                    q.region, info_->fabric_attr->prov_name));
  } else {
    Region* region = pin.get();
    const int slot = (q.access & kAccessWrite) ? 1 : 0;
    std::lock_guard lock(export_mu_);
    auto it = exported_.find(q.region);
    if (it == exported_.end()) {
      it = exported_.emplace(q.region, Exported{}).first;
      it->second.pin = std::move(pin);
    }
    Exported& e = it->second;
    if (!e.mr[slot]) {
      const uint64_t access = FI_REMOTE_READ | (slot ? FI_REMOTE_WRITE : 0);
      const int device =
          region->info.kind == MemoryKind::kCuda ? std::max(region->info.device, 0) : -1;
      int ret = register_mr(region->info.address, region->info.length, access, device, &e.mr[slot]);
      if (ret != 0) {
        g.status = err::Internal(fmt::format("fabric: registering region {} with the provider: {}",
                                             q.region, fi_error(ret)));
      } else {
        e.key[slot] = fi_mr_key(e.mr[slot]);
      }
    }
    if (g.status.ok()) {
      e.importers.insert(p->id);
      g.mr_key = e.key[slot];
      g.base = (mr_mode_ & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(region->info.address) : 0;
    }
    if (!e.mr[0] && !e.mr[1]) exported_.erase(it);
  }
  return send(p, p->addr, MsgType::kGrant, request, encode_grant(g));
}

void FabricTransport::release_revoked_regions() {
  std::vector<std::pair<RegionId, std::vector<PeerId>>> revoked;
  {
    std::lock_guard lock(export_mu_);
    for (auto it = exported_.begin(); it != exported_.end();) {
      if (!it->second.pin.get()->revoked.load()) {
        ++it;
        continue;
      }
      revoked.emplace_back(
          it->first, std::vector<PeerId>(it->second.importers.begin(), it->second.importers.end()));
      if (it->second.importers.empty()) {
        for (auto* mr : it->second.mr) {
          if (mr) fi_close(&mr->fid);
        }
      } else {
        // Keep the registrations and the pin until the importers' ops in
        // flight are done; new ones they post after REVOKE ask for a key
        // and are refused.
        Revoking r;
        r.pin = std::move(it->second.pin);
        for (int i = 0; i < 2; ++i) r.mr[i].reset(it->second.mr[i]);
        r.waiting = it->second.importers;
        r.deadline = Clock::now() + opt_.peer_timeout;
        revoking_[it->first] = std::move(r);
      }
      it = exported_.erase(it);  // drops the pin unless it moved to revoking_
    }
    for (auto it = local_mrs_.begin(); it != local_mrs_.end();) {
      if (it->second.region->revoked.load()) {
        fi_close(&it->second.mr->fid);
        it = local_mrs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [region, importers] : revoked) {
    for (PeerId id : importers) {
      auto p = live_peer(id);
      if (!p.ok() || !send(*p, (*p)->addr, MsgType::kRevoke, 0, encode_u64(region)).ok()) {
        finish_revoke(region, id, false);
      }
    }
  }
}

void FabricTransport::finish_revoke(RegionId region, PeerId peer, bool all) {
  std::lock_guard lock(export_mu_);
  auto it = revoking_.find(region);
  if (it == revoking_.end()) return;
  it->second.waiting.erase(peer);
  if (all || it->second.waiting.empty()) revoking_.erase(it);  // closes the keys, drops the pin
}

bool FabricTransport::in_flight_on_locked(const Peer* p, RegionId region) const {
  for (const auto& op : ops_) {
    if (op->kind == Op::kRma && op->job && op->job->peer.get() == p &&
        op->remote_region == region) {
      return true;
    }
  }
  return false;
}

Status FabricTransport::revoked_error(const Peer& p, RegionId region) const {
  return err::NotFound(
      fmt::format("fabric: region {} on {} was deregistered by its owner", region, describe(p)));
}

void FabricTransport::stop_jobs_on_revoked_locked(const std::shared_ptr<Peer>& p, RegionId region) {
  std::vector<std::shared_ptr<Job>> hit;
  for (auto& job : live_jobs_) {
    if (job->peer != p || job->stopped) continue;
    for (size_t i = job->next; i < job->segs.size(); ++i) {
      if (job->segs[i].remote.region_id == region) {
        hit.push_back(job);
        break;
      }
    }
  }
  for (auto& job : hit) {
    // Ops already posted complete (the target keeps the key until we ack);
    // the rest is not posted and the transfer fails.
    job->stopped = true;
    if (job->error.ok()) job->error = revoked_error(*p, region);
    maybe_finish_locked(job);
  }
}

void FabricTransport::send_due_acks_locked() {
  for (auto it = acks_due_.begin(); it != acks_due_.end();) {
    if (in_flight_on_locked(it->first.get(), it->second)) {
      ++it;
      continue;
    }
    (void)send_locked(it->first, it->first->addr,
                      encode(MsgType::kRevokeAck, ctx_.engine_id, 0, encode_u64(it->second)),
                      nullptr);
    it = acks_due_.erase(it);
  }
}

}  // namespace ferry::fabric
