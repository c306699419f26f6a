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

// The peer this thread looked up last (FabricTransport::find_peer).
struct PeerCache {
  const FabricTransport* owner = nullptr;
  uint64_t version = 0;
  PeerId id = 0;
  std::shared_ptr<Peer> peer;
};
thread_local PeerCache t_peer_cache;
std::atomic<uint64_t> g_peers_version{0};

}  // namespace

fi_addr_t AvTable::insert(const void* name, int* error) {
  std::lock_guard lock(mu_);
  fi_addr_t addr = FI_ADDR_UNSPEC;
  const int n = av_ ? fi_av_insert(av_, name, 1, &addr, 0, nullptr) : -FI_EINVAL;
  if (n != 1) {
    *error = n;
    return FI_ADDR_UNSPEC;
  }
  ++live_;
  return addr;
}

void AvTable::remove(fi_addr_t addr) {
  std::lock_guard lock(mu_);
  if (av_ == nullptr || addr == FI_ADDR_UNSPEC) return;
  if (fi_av_remove(av_, &addr, 1, 0) == 0) --live_;
}

void AvTable::close() {
  std::lock_guard lock(mu_);
  av_ = nullptr;
}

uint64_t AvTable::live() const {
  std::lock_guard lock(mu_);
  return live_;
}

Peer::~Peer() {
  if (av) av->remove(addr);
}

// Errors a provider reports when the connection to the peer is gone.
bool internal::is_disconnect(int err) {
  switch (err) {
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_ENOTCONN:
    case FI_ECONNREFUSED:
    case FI_EHOSTUNREACH:
    case FI_ENETDOWN:
    case FI_ENETUNREACH:
    case FI_ESHUTDOWN:
    case FI_ECANCELED:
    case FI_EIO:
      return true;
    default:
      return false;
  }
}

Bytes internal::encode_address(const AddressBlob& a) {
  Bytes out;
  ByteWriter w(out);
  w.u16(2);
  w.str16(a.provider);
  w.str16(a.fabric);
  w.str16(a.domain);
  w.u16(static_cast<uint16_t>(a.name.size()));
  w.bytes(a.name.data(), a.name.size());
  w.u16(a.flags);
  return out;
}

Result<AddressBlob> internal::decode_address(ByteView b) {
  ByteReader r(b);
  const uint16_t v = r.u16();
  AddressBlob a;
  a.provider = r.str16();
  a.fabric = r.str16();
  a.domain = r.str16();
  const uint16_t n = r.u16();
  auto name = r.bytes(n);
  if (v == 2) a.flags = r.u16();
  if (!r.ok() || r.remaining() != 0 || n == 0 || n > kMaxAddressBytes) {
    return err::InvalidArgument(fmt::format("fabric: malformed peer address ({} bytes)", b.size()));
  }
  if (v != 1 && v != 2) {
    return err::NotSupported(
        fmt::format("fabric: peer address format {} (this engine reads 1 and 2)", v));
  }
  a.name.assign(name.begin(), name.end());
  return a;
}

Bytes FabricTransport::local_address() const {
  return address_;
}

std::string FabricTransport::local_address_text() const {
  return address_text_;
}

std::string FabricTransport::describe(const Peer& p) const {
  return fmt::format("peer {} (fabric {})", hex_id(p.id), p.via);
}

Result<PeerId> FabricTransport::connect(ByteView peer_address, PeerId expected_peer) {
  auto a = decode_address(peer_address);
  if (!a.ok()) return a.status();
  const std::string ours = info_->fabric_attr->prov_name;
  if (a->provider != ours) {
    return err::NotSupported(fmt::format(
        "fabric: the peer runs provider '{}' (domain {}), this engine '{}': they cannot talk",
        a->provider, a->domain, ours));
  }
  std::lock_guard connect_lock(connect_mu_);
  if (expected_peer != 0 && is_connected(expected_peer)) return expected_peer;
  char text[256] = {};
  size_t tlen = sizeof text;
  fi_av_straddr(av_, a->name.data(), text, &tlen);
  int error = 0;
  // Owned by `pending` from here: removed when it goes (a failed handshake,
  // or the peer listed already), or with the peer it becomes.
  auto pending = std::make_shared<Peer>();
  pending->addr = av_table_->insert(a->name.data(), &error);
  if (pending->addr == FI_ADDR_UNSPEC) {
    return err::InvalidArgument(
        fmt::format("fabric: cannot insert the peer address {} into the address vector: {}", text,
                    fi_error(error)));
  }
  pending->av = av_table_;
  const fi_addr_t addr = pending->addr;
  const uint64_t request = next_request_.fetch_add(1);
  {
    std::lock_guard lock(peers_mu_);
    connect_waits_[request] = {};
  }
  Hello h;
  h.protocol = kProtocolVersion;
  h.expected = expected_peer;
  h.provider = ours;
  h.address = ep_name_;
  h.flags = hmem_ ? kHelloHmem : 0;
  pending->hmem = (a->flags & kAddressHmem) != 0;
  pending->via = text;
  if (Status s = send(pending, addr, MsgType::kHello, request, encode_hello(h)); !s.ok()) {
    std::lock_guard lock(peers_mu_);
    connect_waits_.erase(request);
    return s;
  }
  std::unique_lock lock(peers_mu_);
  const bool answered = connect_cv_.wait_for(lock, opt_.connect_timeout,
                                             [&] { return connect_waits_[request].done; });
  ConnectWait w = connect_waits_[request];
  connect_waits_.erase(request);
  if (!answered) {
    return err::Timeout(fmt::format("fabric: no handshake answer from {} within {} ms", text,
                                    opt_.connect_timeout.count()));
  }
  if (!w.status.ok()) {
    return Status(w.status.code(),
                  fmt::format("fabric: {} refused the handshake: {}", text, w.status.message()));
  }
  if (expected_peer != 0 && w.peer != expected_peer) {
    return err::NotFound(fmt::format("fabric: {} is engine {}, not the expected {}", text,
                                     hex_id(w.peer), hex_id(expected_peer)));
  }
  auto it = peers_.find(w.peer);
  if (it == peers_.end() || it->second->dead.load()) {
    pending->id = w.peer;
    pending->last_heard.store(now_ns());
    peers_[w.peer] = pending;
    peers_changed_locked(pending.get());
  }
  spdlog::debug("fabric: connected to engine {} at {}", hex_id(w.peer), text);
  return w.peer;
}

bool FabricTransport::is_connected(PeerId peer) const {
  const auto& p = find_peer(peer);
  return p && !p->dead.load();
}

std::string FabricTransport::peer_address(PeerId peer) const {
  std::lock_guard lock(peers_mu_);
  auto it = peers_.find(peer);
  return it == peers_.end() || it->second->dead.load() ? std::string() : it->second->via;
}

uint64_t FabricTransport::next_peers_version() {
  return g_peers_version.fetch_add(1) + 1;
}

void FabricTransport::peers_changed_locked(const Peer* added) {
  if (added && added->hmem) any_peer_hmem_.store(true, std::memory_order_release);
  peers_version_.store(next_peers_version(), std::memory_order_release);
}

const std::shared_ptr<Peer>& FabricTransport::find_peer(PeerId peer) const {
  PeerCache& c = *detail::tls_address(t_peer_cache);
  if (c.owner == this && c.id == peer &&
      c.version == peers_version_.load(std::memory_order_acquire)) {
    return c.peer;
  }
  std::lock_guard lock(peers_mu_);
  auto it = peers_.find(peer);
  c.owner = this;
  c.version = peers_version_.load(std::memory_order_relaxed);
  c.id = peer;
  c.peer = it == peers_.end() ? nullptr : it->second;
  return c.peer;
}

Result<std::shared_ptr<Peer>> FabricTransport::live_peer(PeerId peer) const {
  const std::shared_ptr<Peer>& p = find_peer(peer);
  if (!p) {
    std::lock_guard lock(peers_mu_);
    if (auto it = departed_.find(peer); it != departed_.end()) {
      return err::PeerDisconnected(fmt::format("fabric: peer {}: {}", hex_id(peer), it->second));
    }
    return err::PeerDisconnected(
        fmt::format("fabric: peer {} is not connected (lost or never connected)", hex_id(peer)));
  }
  if (p->dead.load()) {
    std::lock_guard plock(p->mu);
    return err::PeerDisconnected(fmt::format("fabric: {}: {}", describe(*p), p->dead_reason));
  }
  return p;
}

void FabricTransport::timers() {
  const auto now = Clock::now();
  if (now < next_ping_) return;
  next_ping_ = now + opt_.peer_timeout / 6;
  {
    std::lock_guard lock(export_mu_);
    for (auto it = revoking_.begin(); it != revoking_.end();) {
      if (now < it->second.deadline) {
        ++it;
        continue;
      }
      spdlog::warn(
          "ferry: fabric: region {}: {} importer(s) did not confirm the revocation "
          "within {} ms; deregistration goes on",
          it->first, it->second.waiting.size(), opt_.peer_timeout.count());
      it = revoking_.erase(it);
    }
  }
  std::vector<std::shared_ptr<Peer>> peers;
  {
    std::lock_guard lock(peers_mu_);
    for (auto& [id, p] : peers_) {
      if (!p->dead.load()) peers.push_back(p);
    }
  }
  const int64_t t = now_ns();
  for (auto& p : peers) {
    const int64_t silent = t - p->last_heard.load();
    if (silent > std::chrono::duration_cast<std::chrono::nanoseconds>(opt_.peer_timeout).count()) {
      fail_peer(p, err::PeerDisconnected(fmt::format(
                       "fabric: {} not heard from for {} ms (fabric.peer_timeout_ms {}): "
                       "declared dead",
                       describe(*p), silent / 1000000, opt_.peer_timeout.count())));
      continue;
    }
    (void)send(p, p->addr, MsgType::kPing, 0, {});
  }
}

void FabricTransport::fail_peer(const std::shared_ptr<Peer>& p, const Status& reason) {
  if (p->dead.exchange(true)) return;
  {
    std::lock_guard lock(p->mu);
    p->dead_reason = reason.message();
    p->grants.clear();
  }
  {
    // Unlisted, so that its address vector entry goes with the last op (and
    // lookup cache) holding it; its reason stays for errors that name it.
    std::lock_guard lock(peers_mu_);
    if (auto it = peers_.find(p->id); it != peers_.end() && it->second == p) {
      peers_.erase(it);
      peers_changed_locked(nullptr);
      if (departed_.emplace(p->id, reason.message()).second) {
        departed_order_.push_back(p->id);
      } else {
        departed_[p->id] = reason.message();
      }
      while (departed_order_.size() > kDepartedKept) {
        departed_.erase(departed_order_.front());
        departed_order_.pop_front();
      }
    }
  }
  p->cv.notify_all();
  Status why = reason.code() == StatusCode::kPeerDisconnected
                   ? reason
                   : err::PeerDisconnected(reason.message());
  size_t failed = 0;
  {
    std::lock_guard lock(post_mu_);
    std::vector<std::shared_ptr<Job>> mine;
    for (auto& j : live_jobs_) {
      if (j->peer == p) mine.push_back(j);
    }
    failed = mine.size();
    for (auto& j : mine) {
      // Nothing more of it is posted (see cancel()). What the provider holds
      // already may still write its buffers -- a stopped peer resumes and
      // answers -- so the transfer fails when the last of that comes back.
      j->stopped = true;
      if (j->error.ok()) j->error = why;
      drop_queued_locked(*j);
      maybe_finish_locked(j);
    }
    // Then its messages still waiting for room (the provider said FI_EAGAIN; a
    // dead peer's connection never makes any) are dropped: each holds the
    // peer, and with it the peer's address vector entry.
    for (auto it = send_queue_.begin(); it != send_queue_.end();) {
      Op* op = *it;
      if (op->peer != p) {
        ++it;
        continue;
      }
      it = send_queue_.erase(it);
      on_completion(op, why);
    }
    notify_job_waiters_locked();
  }
  {
    std::lock_guard lock(export_mu_);
    for (auto& [id, e] : exported_) e.importers.erase(p->id);
    for (auto it = revoking_.begin(); it != revoking_.end();) {
      it->second.waiting.erase(p->id);
      it = it->second.waiting.empty() ? revoking_.erase(it) : std::next(it);
    }
  }
  if (!stop_.load()) {
    if (failed > 0) {
      spdlog::warn("ferry: {} ({} transfers failed)", why.message(), failed);
    } else {
      spdlog::info("ferry: {}", why.message());
    }
    ctx_.events->on_peer_down(p->id, why);
  }
}

void FabricTransport::on_message(const uint8_t* data, size_t len) {
  auto h = decode_header(data, len);
  if (!h.ok()) {
    // We cannot tell reliably who sent garbage without a header; drop it.
    spdlog::warn("ferry: fabric: dropped a malformed message: {}", h.status().message());
    return;
  }
  Status s = handle(*h, ByteView(data + kHeaderBytes, h->body_bytes));
  if (!s.ok()) {
    std::shared_ptr<Peer> p;
    {
      std::lock_guard lock(peers_mu_);
      auto it = peers_.find(h->sender);
      if (it != peers_.end()) p = it->second;
    }
    if (p) {
      fail_peer(p, Status(s.code(), fmt::format("fabric: {} sent a bad {}: {}", describe(*p),
                                                msg_type_name(h->type), s.message())));
    } else {
      spdlog::warn("ferry: fabric: bad {} from engine {}: {}", msg_type_name(h->type),
                   hex_id(h->sender), s.message());
    }
  }
}

Status FabricTransport::handle(const Header& h, ByteView body) {
  const auto type = static_cast<MsgType>(h.type);
  if (type == MsgType::kHello) {
    auto hello = decode_hello(body);
    if (!hello.ok()) return hello.status();
    auto p = std::make_shared<Peer>();
    int error = 0;
    p->addr = av_table_->insert(hello->address.data(), &error);
    if (p->addr == FI_ADDR_UNSPEC) {
      return err::ProtocolError(fmt::format(
          "fabric: HELLO carries an address the provider rejects: {}", fi_error(error)));
    }
    p->av = av_table_;
    const fi_addr_t addr = p->addr;
    // The answer goes to this entry, so its owner lives until the send is done
    // even where the peer turns out to be listed already.
    const std::shared_ptr<Peer> hello_peer = p;
    char text[256] = {};
    size_t tlen = sizeof text;
    fi_av_straddr(av_, hello->address.data(), text, &tlen);
    p->id = h.sender;
    p->via = text;
    p->hmem = (hello->flags & kHelloHmem) != 0;
    p->last_heard.store(now_ns());
    Status verdict;
    if (hello->protocol != kProtocolVersion) {
      verdict = err::ProtocolError(
          fmt::format("protocol version mismatch: engine {} speaks {}, this engine {} speaks {}",
                      hex_id(h.sender), hello->protocol, hex_id(ctx_.engine_id), kProtocolVersion));
    } else if (hello->expected != 0 && hello->expected != ctx_.engine_id) {
      verdict = err::NotFound(fmt::format("this is engine {}, not {}", hex_id(ctx_.engine_id),
                                          hex_id(hello->expected)));
    } else if (hello->provider != info_->fabric_attr->prov_name) {
      verdict = err::NotSupported(fmt::format("provider '{}' here, '{}' there",
                                              info_->fabric_attr->prov_name, hello->provider));
    }
    bool fresh = false;
    if (verdict.ok()) {
      std::lock_guard lock(peers_mu_);
      auto it = peers_.find(h.sender);
      if (it == peers_.end() || it->second->dead.load()) {
        peers_[h.sender] = p;
        peers_changed_locked(p.get());
        fresh = true;
      } else {
        p = it->second;
        p->last_heard.store(now_ns());
      }
    }
    (void)send(hello_peer, addr, MsgType::kHelloAck, h.request, encode_status(verdict));
    if (fresh) ctx_.events->on_peer_up(h.sender);
    return Status::Ok();
  }
  if (type == MsgType::kHelloAck) {
    Status answer;
    if (Status s = decode_status(body, &answer); !s.ok()) return s;
    std::lock_guard lock(peers_mu_);
    auto it = connect_waits_.find(h.request);
    if (it != connect_waits_.end()) {
      it->second.done = true;
      it->second.peer = h.sender;
      it->second.status = answer;
      connect_cv_.notify_all();
    }
    return Status::Ok();
  }
  std::shared_ptr<Peer> p;
  {
    std::lock_guard lock(peers_mu_);
    auto it = peers_.find(h.sender);
    if (it != peers_.end() && !it->second->dead.load()) p = it->second;
  }
  if (!p) {
    // A late message of a peer declared dead, or one that never said HELLO.
    spdlog::debug("fabric: {} from unknown engine {} dropped", msg_type_name(h.type),
                  hex_id(h.sender));
    return Status::Ok();
  }
  p->last_heard.store(now_ns());
  switch (type) {
    case MsgType::kGrantReq: {
      auto q = decode_grant_req(body);
      if (!q.ok()) return q.status();
      return serve_grant(p, h.request, *q);
    }
    case MsgType::kGrant: {
      auto g = decode_grant(body);
      if (!g.ok()) return g.status();
      std::lock_guard lock(p->mu);
      auto it = p->grant_waits.find(h.request);
      if (it == p->grant_waits.end()) return Status::Ok();  // timed out meanwhile
      it->second.done = true;
      it->second.grant = *g;
      p->cv.notify_all();
      return Status::Ok();
    }
    case MsgType::kRevoke: {
      auto region = decode_u64(body, "REVOKE");
      if (!region.ok()) return region.status();
      {
        std::lock_guard lock(p->mu);
        for (auto it = p->grants.begin(); it != p->grants.end();) {
          it = std::get<0>(it->first) == *region ? p->grants.erase(it) : std::next(it);
        }
        p->revoked.insert(*region);
      }
      {
        std::lock_guard lock(post_mu_);
        ++p->revoke_gen;
        stop_jobs_on_revoked_locked(p, *region);
        acks_due_.emplace_back(p, *region);
        send_due_acks_locked();
      }
      return Status::Ok();
    }
    case MsgType::kRevokeAck: {
      auto region = decode_u64(body, "REVOKE_ACK");
      if (!region.ok()) return region.status();
      finish_revoke(*region, p->id, false);
      return Status::Ok();
    }
    case MsgType::kNotify:
      ctx_.events->on_notification(p->id, Bytes(body.begin(), body.end()));
      return Status::Ok();
    case MsgType::kPing:
      (void)send(p, p->addr, MsgType::kPong, h.request, {});
      return Status::Ok();
    case MsgType::kPong:
      return Status::Ok();
    case MsgType::kBye:
      if (!body.empty()) return err::ProtocolError("fabric: BYE has a body");
      fail_peer(
          p, err::PeerDisconnected(fmt::format("fabric: {} shut down its engine", describe(*p))));
      return Status::Ok();
    default:
      return err::ProtocolError(fmt::format("fabric: unexpected {}", msg_type_name(h.type)));
  }
}

}  // namespace ferry::fabric
