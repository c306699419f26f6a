#include "transport/fabric/fabric_transport.h"

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

namespace ferry::fabric {

const OptionSpec kFabricOptionSpecs[] = {
    {"fabric.library", OptionType::kString, "libfabric.so.1",
     "libfabric shared library opened with dlopen (a path, or a name the loader finds)"},
    {"fabric.provider", OptionType::kString, "",
     "libfabric provider (cxi, efa, verbs;ofi_rxm, tcp;ofi_rxm, ...); empty: the first one "
     "offering reliable-datagram endpoints with RMA (FI_PROVIDER narrows libfabric's list too)"},
    {"fabric.domain", OptionType::kString, "",
     "libfabric domain (NIC) name, e.g. cxi0, rdmap0s6-rdm, mlx5_0, eth0; empty: the first"},
    {"fabric.max_inflight", OptionType::kUint, "256",
     "most RMA operations posted and not yet completed (larger batches are posted in windows)", 1,
     65536},
    {"fabric.max_inflight_bytes", OptionType::kBytes, "64MiB",
     "most RMA payload bytes posted and not yet completed", 4096, 1ull << 40},
    {"fabric.connect_timeout_ms", OptionType::kDurationMs, "5000",
     "time allowed for the fabric handshake with a peer", 1, 600000},
    {"fabric.grant_timeout_ms", OptionType::kDurationMs, "10000",
     "time allowed for a peer to answer a key request (first use of a descriptor)", 1, 600000},
    {"fabric.peer_timeout_ms", OptionType::kDurationMs, "1500",
     "a peer not heard from (keepalive) this long is declared dead and its transfers fail", 100,
     600000},
    {"fabric.poll_spin_us", OptionType::kUint, "50",
     "the progress thread polls the completion queue this long after its last event before it "
     "sleeps (a provider with manual progress moves bytes only while polled)",
     0, 1000000},
    {"fabric.combine_after", OptionType::kUint, "2",
     "small operations to a peer with this many RMA operations in flight wait and go out "
     "combined, several to one provider operation, where the provider takes several remote iovs "
     "per operation (tcp;ofi_rxm: 4); 0: never combined",
     0, 65536},
    {"fabric.combine_max_bytes", OptionType::kBytes, "64KiB",
     "the largest one-segment operation that may be combined with others (fabric.combine_after)", 1,
     8ull << 20},
    {"fabric.hmem", OptionType::kString, "auto",
     "GPU memory registered with the provider (FI_HMEM, CUDA): auto (where the provider offers "
     "it), on (required: the transport does not start without it), off (local GPU memory is "
     "staged through pinned host memory; the peer's GPU memory goes to another transport)"},
    {"fabric.gpu_staging_bytes", OptionType::kBytes, "64MiB",
     "pinned host memory through which local GPU memory is staged without FI_HMEM (1 MiB "
     "slots; allocated on the first such transfer)",
     2ull << 20, 16ull << 30},
};
const size_t kFabricOptionSpecCount = std::size(kFabricOptionSpecs);

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kRecvBuffers = 16;
constexpr size_t kCqBatch = 64;
// How long a waiter's last poll of the CQ keeps the progress thread off it,
// unless the waiter says it stopped (stop_polling) -- a waiter that returned
// with its transfer done usually comes back soon with the next one.
constexpr int64_t kWaiterLeaseNs = 200000;
// While a waiter keeps renewing its lease, the progress thread's naps grow
// from kWaiterLeaseNs to this (each wake-up to look costs a context switch,
// on 2 cores a preempted thread: 3,400 a second at 200 us). So a waiter that
// leaves without stop_polling() -- its transfer done, nothing else waited on
// -- gives the CQ back within this at worst.
constexpr int64_t kMaxWaiterNapNs = 1000000;
// Core's wait() polls (spins) only on transfers of at most this many bytes
// (kSpinMaxBytes in core/engine.cc): a larger one posted while a waiter holds
// the lease brings the progress thread back at once.
constexpr uint64_t kPolledMaxBytes = 256 << 10;
// The longest the progress thread polls after its last event (it grows from
// fabric.poll_spin_us while wake-ups follow each other closely).
constexpr std::chrono::microseconds kMaxPollSpin{2000};
constexpr uint32_t kApiVersion = FI_VERSION(1, 9);
// FI_HMEM with a CUDA device in fi_mr_attr (fi_mr_regattr).
constexpr uint32_t kHmemApiVersion = FI_VERSION(1, 10);
// One staging slot: a GPU piece of a transfer, the most one RMA op of it moves.
constexpr uint64_t kStagingSlotBytes = 1 << 20;
// Address blob flags.
constexpr uint16_t kAddressHmem = 1;  // the engine registers GPU memory with FI_HMEM

std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

// The peer this thread looked up last (FabricTransport::find_peer).
struct PeerCache {
  const FabricTransport* owner = nullptr;
  uint64_t version = 0;
  PeerId id = 0;
  std::shared_ptr<Peer> peer;
};
thread_local PeerCache t_peer_cache;
// The key this thread got last from a peer's grants (FabricTransport::grant_for).
struct GrantCache {
  std::shared_ptr<Peer> peer;  // held: its address is not reused while cached
  uint64_t revoke_gen = 0;
  GrantKey key;
  RemoteKey value;
};
thread_local GrantCache t_grant_cache;
std::atomic<uint64_t> g_peers_version{0};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

GrantKey key_of(const RemoteAccessRequest& r) {
  return {r.region_id, r.adv_offset, r.adv_length, r.key, r.access};
}

std::string mr_mode_text(uint64_t m) {
  std::string s;
  auto add = [&](uint64_t bit, const char* name) {
    if (m & bit) s += (s.empty() ? "" : "|") + std::string(name);
  };
  add(FI_MR_LOCAL, "LOCAL");
  add(FI_MR_VIRT_ADDR, "VIRT_ADDR");
  add(FI_MR_ALLOCATED, "ALLOCATED");
  add(FI_MR_PROV_KEY, "PROV_KEY");
  add(FI_MR_ENDPOINT, "ENDPOINT");
  add(FI_MR_HMEM, "HMEM");
  return fmt::format("{:#x} ({})", m, s.empty() ? "offsets, user keys" : s);
}

// Errors a provider reports when the connection to the peer is gone.
bool is_disconnect(int err) {
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

// Format 2 adds the flags (format 1, without them, is still read).
struct AddressBlob {
  std::string provider, fabric, domain;
  Bytes name;
  uint16_t flags = 0;
};

Bytes encode_address(const AddressBlob& a) {
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

Result<AddressBlob> decode_address(ByteView b) {
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

}  // namespace

FabricTransport::~FabricTransport() {
  shutdown(err::Cancelled("fabric transport destroyed"));
}

// Local GPU memory: directly under FI_HMEM, else staged (needs CUDA here).
// The peer's GPU memory: only where the peer registers it with FI_HMEM,
// which capabilities_for() knows per peer.
TransportCaps FabricTransport::capabilities() const {
  TransportCaps c;
  c.host_memory = true;
  c.cuda_memory = hmem_ || cuda_available();
  c.local_gpu_only = true;
  c.varies_by_peer = true;
  c.metadata_only = true;
  return c;
}

TransportCaps FabricTransport::capabilities_for(PeerId peer) const {
  TransportCaps c = capabilities();
  if (!any_peer_hmem_.load(std::memory_order_acquire)) return c;
  if (const auto& p = find_peer(peer); p && p->hmem) {
    c.cuda_memory = true;
    c.local_gpu_only = false;
  }
  return c;
}

std::string FabricTransport::peer_limits(PeerId peer) const {
  bool peer_hmem = false;
  {
    std::lock_guard lock(peers_mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return {};
    peer_hmem = it->second->hmem;
  }
  if (peer_hmem) return {};
  return fmt::format(
      "peer GPU memory: the peer does not register GPU memory with FI_HMEM (provider {}), so "
      "it cannot be reached one-sided{}",
      info_ ? info_->fabric_attr->prov_name : "?",
      capabilities().cuda_memory ? "; local GPU memory with peer host memory is carried" +
                                       std::string(hmem_ ? " (FI_HMEM)" : " (staged)")
                                 : "");
}

std::string FabricTransport::fi_error(int ret) const {
  const int e = ret < 0 ? -ret : ret;
  return fmt::format("{} ({})", api_.strerror ? api_.strerror(e) : "?", e);
}

Status FabricTransport::load_library() {
  ::dlerror();
  api_.handle = ::dlopen(opt_.library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!api_.handle) {
    const char* why = ::dlerror();
    return err::NotSupported(fmt::format("fabric: cannot load libfabric '{}' (fabric.library): {}",
                                         opt_.library, why ? why : "unknown error"));
  }
  auto sym = [&](const char* name) { return ::dlsym(api_.handle, name); };
  api_.getinfo = reinterpret_cast<decltype(api_.getinfo)>(sym("fi_getinfo"));
  api_.freeinfo = reinterpret_cast<decltype(api_.freeinfo)>(sym("fi_freeinfo"));
  api_.dupinfo = reinterpret_cast<decltype(api_.dupinfo)>(sym("fi_dupinfo"));
  api_.fabric = reinterpret_cast<decltype(api_.fabric)>(sym("fi_fabric"));
  api_.strerror = reinterpret_cast<decltype(api_.strerror)>(sym("fi_strerror"));
  api_.version = reinterpret_cast<decltype(api_.version)>(sym("fi_version"));
  if (!api_.getinfo || !api_.freeinfo || !api_.dupinfo || !api_.fabric || !api_.strerror ||
      !api_.version) {
    return err::NotSupported(
        fmt::format("fabric: '{}' lacks the libfabric entry points (fi_getinfo, fi_fabric, ...)",
                    opt_.library));
  }
  if (api_.version() < kApiVersion) {
    return err::NotSupported(fmt::format("fabric: libfabric {}.{} is older than 1.9",
                                         FI_MAJOR(api_.version()), FI_MINOR(api_.version())));
  }
  return Status::Ok();
}

Status FabricTransport::open_fabric() {
  struct fi_info* hints = api_.dupinfo(nullptr);
  if (!hints) return err::Internal("fabric: fi_allocinfo failed");
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps =
      FI_RMA | FI_MSG | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->domain_attr->threading = FI_THREAD_SAFE;
  hints->addr_format = FI_FORMAT_UNSPEC;
  // FI_HMEM (GPU memory registered with the provider): asked for first under
  // fabric.hmem=auto|on where CUDA answers; auto falls back to plain host
  // memory (local GPU memory is then staged).
  std::string no_hmem;
  bool want_hmem = opt_.hmem != FabricOptions::Hmem::kOff;
  if (want_hmem && !cuda_available(&no_hmem)) want_hmem = false;
  if (want_hmem && api_.version() < kHmemApiVersion) {
    want_hmem = false;
    no_hmem = "libfabric older than 1.10";
  }
  if (opt_.hmem == FabricOptions::Hmem::kOn && !want_hmem) {
    api_.freeinfo(hints);
    return err::NotSupported("fabric: fabric.hmem=on, but GPU memory cannot be registered: " +
                             no_hmem);
  }
  if (!opt_.provider.empty()) hints->fabric_attr->prov_name = ::strdup(opt_.provider.c_str());
  if (!opt_.domain.empty()) hints->domain_attr->name = ::strdup(opt_.domain.c_str());

  // Socket-based providers bind to an interface address: use the engine's
  // listen host when it names one, so the address we publish is reachable
  // where tcp's is (network namespaces, multi-homed hosts).
  std::string node;
  const size_t colon = ctx_.listen.rfind(':');
  if (colon != std::string::npos) node = ctx_.listen.substr(0, colon);
  if (!node.empty() && node.front() == '[') node = node.substr(1, node.size() - 2);
  if (node == "0.0.0.0" || node == "::" || node == "*") node.clear();

  // Keys are carried as 64 bits (raw keys are passed over). Unless a provider is named,
  // same-host-only providers (shm, sm2) are passed over: this transport is for reaching other hosts
  // -- the engine's shm and cuda_ipc transports cover this one -- and libfabric's shm, first in the
  // list where it is built (Ubuntu's libfabric), names its endpoints after the address, so two
  // engines on one host collided (fi_enable: EBUSY; a handshake answered by the wrong engine).
  std::string passed_over;  // "name (why)", for the error when nothing is left
  auto pass_over = [&](const std::string& name, const char* why) {
    const std::string item = name + " (" + why + ")";
    if (passed_over.find(item) == std::string::npos) {
      passed_over += (passed_over.empty() ? "" : ", ") + item;
    }
    return false;
  };
  auto usable = [&](const struct fi_info* i) {
    const std::string name = i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "";
    if (i->domain_attr->mr_key_size > 8 || (i->domain_attr->mr_mode & FI_MR_RAW)) {
      return pass_over(name, "keys over 8 bytes");
    }
    if (opt_.provider.empty()) {
      for (const char* local : {"shm", "sm2"}) {
        if (name == local || name.rfind(std::string(local) + ";", 0) == 0) {
          return pass_over(name, "same host only; name it with fabric.provider to use it");
        }
      }
    }
    return true;
  };
  auto any_usable = [&](const struct fi_info* l) {
    for (; l; l = l->next) {
      if (usable(l)) return true;
    }
    return false;
  };

  struct fi_info* list = nullptr;
  int ret = -FI_ENODATA;
  const uint64_t base_caps = hints->caps;
  const uint64_t base_mr_mode = hints->domain_attr->mr_mode;
  for (int with_hmem = want_hmem ? 1 : 0; with_hmem >= 0 && ret != 0; --with_hmem) {
    hints->caps = base_caps | (with_hmem ? FI_HMEM : 0);
    hints->domain_attr->mr_mode = base_mr_mode | (with_hmem ? FI_MR_HMEM : 0);
    // Ask for delivery-complete writes first (a write's completion then means
    // the bytes are placed at the target); without it, plain completions.
    for (int attempt = 0; attempt < 4 && ret != 0; ++attempt) {
      const bool dc = attempt % 2 == 0;
      const bool with_node = attempt < 2 && !node.empty();
      if (attempt < 2 && node.empty() && attempt == 1) continue;
      hints->tx_attr->op_flags = dc ? FI_DELIVERY_COMPLETE : 0;
      ret = api_.getinfo(with_hmem ? kHmemApiVersion : kApiVersion,
                         with_node ? node.c_str() : nullptr, nullptr, with_node ? FI_SOURCE : 0,
                         hints, &list);
      if (ret == 0 && !any_usable(list)) {
        api_.freeinfo(list);
        list = nullptr;
        ret = -FI_ENODATA;
      }
      if (ret == 0) {
        delivery_complete_ = dc;
        hmem_ = with_hmem != 0;
      }
    }
    if (ret != 0 && with_hmem) {
      no_hmem = fmt::format("no provider{} offers FI_HMEM",
                            opt_.provider.empty() ? std::string() : " '" + opt_.provider + "'");
      if (opt_.hmem == FabricOptions::Hmem::kOn) break;
    }
  }
  api_.freeinfo(hints);
  if (ret != 0 && opt_.hmem == FabricOptions::Hmem::kOn) {
    return err::NotSupported("fabric: fabric.hmem=on, but " + no_hmem + ": " + fi_error(ret));
  }
  if (ret != 0 || !list) {
    return err::NotSupported(fmt::format(
        "fabric: no libfabric provider offers reliable-datagram endpoints with RMA{}{}{}: {}",
        opt_.provider.empty() ? "" : " as provider '" + opt_.provider + "'",
        opt_.domain.empty() ? "" : " on domain '" + opt_.domain + "'",
        passed_over.empty() ? "" : " (passed over: " + passed_over + ")", fi_error(ret)));
  }
  struct fi_info* pick = list;  // any_usable(list) held
  while (!usable(pick)) pick = pick->next;
  info_ = api_.dupinfo(pick);
  api_.freeinfo(list);

  mr_mode_ = info_->domain_attr->mr_mode;
  iov_limit_ = std::clamp<size_t>(info_->tx_attr->iov_limit, 1, Op::kMaxIov);
  rma_iov_limit_ = std::clamp<size_t>(info_->tx_attr->rma_iov_limit, 1, Op::kMaxIov);
  combine_limit_ = opt_.combine_after == 0 ? 1 : std::min(iov_limit_, rma_iov_limit_);
  if (info_->ep_attr->max_msg_size > 0) {
    max_op_bytes_ = std::min<uint64_t>(max_op_bytes_, info_->ep_attr->max_msg_size);
  }
  const std::string prov = info_->fabric_attr->prov_name;
  auto fail = [&](const char* what, int r) {
    return err::NotSupported(fmt::format("fabric: {} {}: {}", prov, what, fi_error(r)));
  };
  if ((ret = api_.fabric(info_->fabric_attr, &fabric_, nullptr)) != 0)
    return fail("fi_fabric", ret);
  if ((ret = fi_domain(fabric_, info_, &domain_, nullptr)) != 0) return fail("fi_domain", ret);
  struct fi_cq_attr cq_attr {};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.wait_obj = FI_WAIT_FD;
  cq_attr.size = 0;
  if ((ret = fi_cq_open(domain_, &cq_attr, &cq_, nullptr)) != 0) {
    cq_attr.wait_obj = FI_WAIT_NONE;
    if ((ret = fi_cq_open(domain_, &cq_attr, &cq_, nullptr)) != 0) return fail("fi_cq_open", ret);
  } else if (fi_control(&cq_->fid, FI_GETWAIT, &cq_fd_) != 0) {
    cq_fd_ = -1;
  }
  struct fi_av_attr av_attr {};
  av_attr.type = FI_AV_TABLE;
  if ((ret = fi_av_open(domain_, &av_attr, &av_, nullptr)) != 0) return fail("fi_av_open", ret);
  if ((ret = fi_endpoint(domain_, info_, &ep_, nullptr)) != 0) return fail("fi_endpoint", ret);
  if ((ret = fi_ep_bind(ep_, &av_->fid, 0)) != 0) return fail("fi_ep_bind(av)", ret);
  if ((ret = fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV)) != 0) {
    return fail("fi_ep_bind(cq)", ret);
  }
  if ((ret = fi_enable(ep_)) != 0) return fail("fi_enable", ret);
  size_t len = 0;
  fi_getname(&ep_->fid, nullptr, &len);
  if (len == 0 || len > kMaxAddressBytes) return fail("fi_getname", -FI_EINVAL);
  ep_name_.resize(len);
  if ((ret = fi_getname(&ep_->fid, ep_name_.data(), &len)) != 0) return fail("fi_getname", ret);
  ep_name_.resize(len);
  char text[256] = {};
  size_t tlen = sizeof text;
  fi_av_straddr(av_, ep_name_.data(), text, &tlen);
  address_ = encode_address({prov, info_->fabric_attr->name ? info_->fabric_attr->name : "",
                             info_->domain_attr->name ? info_->domain_attr->name : "", ep_name_,
                             static_cast<uint16_t>(hmem_ ? kAddressHmem : 0)});
  const std::string gpu_text =
      hmem_ ? std::string("GPU memory: FI_HMEM")
            : fmt::format("GPU memory: {}; peer GPU memory only where the peer has FI_HMEM",
                          cuda_available()
                              ? "local staged through pinned host memory (no FI_HMEM" +
                                    (no_hmem.empty() ? std::string() : ": " + no_hmem) + ")"
                              : "none (no CUDA here)");
  const std::string combine_text =
      combine_limit_ > 1 ? fmt::format("up to {} small ops combined beyond {} in flight to a peer",
                                       combine_limit_, opt_.combine_after)
                         : std::string("small ops not combined");
  address_text_ = fmt::format(
      "{} domain {} at {} (mr_mode {}, {} completion, iov_limit {}, {}; {})", prov,
      info_->domain_attr->name ? info_->domain_attr->name : "?", text, mr_mode_text(mr_mode_),
      delivery_complete_ ? "delivery" : "transmit", iov_limit_, combine_text, gpu_text);
  return Status::Ok();
}

Status FabricTransport::start(const TransportContext& context) {
  // Threads created from here on -- ours and libfabric's own progress
  // threads -- must not take the application's signals (Ctrl-C has to reach
  // the thread that waits, e.g. Python's main thread): block them while
  // starting; the caller's mask is restored on return.
  // libfabric's providers may also install handlers of their own (one that
  // exits on SIGINT stopped Python's KeyboardInterrupt): the application's
  // handlers are put back afterwards.
  sigset_t all, saved;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &saved);
  constexpr int kKept[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2};
  struct sigaction handlers[std::size(kKept)];
  for (size_t i = 0; i < std::size(kKept); ++i) sigaction(kKept[i], nullptr, &handlers[i]);
  Status s = start_unmasked(context);
  for (size_t i = 0; i < std::size(kKept); ++i) sigaction(kKept[i], &handlers[i], nullptr);
  pthread_sigmask(SIG_SETMASK, &saved, nullptr);
  return s;
}

Status FabricTransport::start_unmasked(const TransportContext& context) {
  ctx_ = context;
  const OptionSet& o = *ctx_.options;
  opt_.library = o.get_string("fabric.library");
  opt_.provider = o.get_string("fabric.provider");
  opt_.domain = o.get_string("fabric.domain");
  opt_.max_inflight = static_cast<uint32_t>(o.get_uint("fabric.max_inflight"));
  opt_.max_inflight_bytes = o.get_uint("fabric.max_inflight_bytes");
  opt_.connect_timeout = std::chrono::milliseconds(o.get_uint("fabric.connect_timeout_ms"));
  opt_.grant_timeout = std::chrono::milliseconds(o.get_uint("fabric.grant_timeout_ms"));
  opt_.peer_timeout = std::chrono::milliseconds(o.get_uint("fabric.peer_timeout_ms"));
  opt_.poll_spin = std::chrono::microseconds(o.get_uint("fabric.poll_spin_us"));
  opt_.combine_after = static_cast<uint32_t>(o.get_uint("fabric.combine_after"));
  opt_.combine_max_bytes = o.get_uint("fabric.combine_max_bytes");
  opt_.gpu_staging_bytes = o.get_uint("fabric.gpu_staging_bytes");
  const std::string hmem = o.get_string("fabric.hmem");
  if (hmem == "auto") {
    opt_.hmem = FabricOptions::Hmem::kAuto;
  } else if (hmem == "on") {
    opt_.hmem = FabricOptions::Hmem::kOn;
  } else if (hmem == "off") {
    opt_.hmem = FabricOptions::Hmem::kOff;
  } else {
    return err::InvalidArgument(
        fmt::format("option fabric.hmem: '{}' is not one of auto, on, off", hmem));
  }
  if (Status s = load_library(); !s.ok()) return s;
  if (Status s = open_fabric(); !s.ok()) {
    shutdown(s);
    return s;
  }
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return err::Internal("fabric: eventfd failed");
  {
    std::lock_guard lock(post_mu_);
    for (size_t i = 0; i < kRecvBuffers; ++i) {
      Op* op = take_op();
      op->kind = Op::kRecv;
      op->buf.resize(kMaxMessageBytes);
      if (Status s = post_recv(op); !s.ok()) return s;
      recvs_.push_back(op);
    }
  }
  {
    std::lock_guard lock(life_mu_);
    started_ = true;
  }
  next_ping_ = Clock::now() + opt_.peer_timeout / 6;
  progress_ = std::thread([this] { progress_loop(); });
  spdlog::info("ferry: fabric: {}", address_text_);
  return Status::Ok();
}

Status FabricTransport::post_recv(Op* op) {
  if ((mr_mode_ & FI_MR_LOCAL) && !op->mr) {
    int r = fi_mr_reg(domain_, op->buf.data(), op->buf.size(), FI_RECV | FI_SEND, 0,
                      next_key_.fetch_add(1), 0, &op->mr, nullptr);
    if (r != 0) return err::Internal("fabric: registering a receive buffer: " + fi_error(r));
  }
  for (;;) {
    ssize_t r = fi_recv(ep_, op->buf.data(), op->buf.size(), op->mr ? fi_mr_desc(op->mr) : nullptr,
                        FI_ADDR_UNSPEC, &op->ctx);
    if (r == 0) return Status::Ok();
    if (r != -FI_EAGAIN) return err::Internal("fabric: fi_recv: " + fi_error(static_cast<int>(r)));
    // The receive queue is full only while the provider has work to do.
    std::this_thread::yield();
  }
}

void FabricTransport::shutdown(const Status& reason) {
  {
    std::lock_guard lock(life_mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  if (progress_.joinable()) {
    // Tell peers, so their transfers fail now rather than at the keepalive
    // deadline; give the sends a moment to leave.
    std::vector<std::shared_ptr<Peer>> peers;
    {
      std::lock_guard lock(peers_mu_);
      for (auto& [id, p] : peers_) peers.push_back(p);
    }
    for (auto& p : peers) {
      if (!p->dead.load()) (void)send(p, p->addr, MsgType::kBye, 0, {});
    }
    if (!peers.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    stop_.store(true);
    wake(/*urgent=*/true);
    progress_.join();
  }
  stop_.store(true);
  // A waiter polling the CQ (progress()) checked stop_ under cq_mu_: once we
  // have held it, none is still reading what is closed below.
  { std::lock_guard cq(cq_mu_); }
  std::vector<std::shared_ptr<Peer>> peers;
  {
    std::lock_guard lock(peers_mu_);
    for (auto& [id, p] : peers_) peers.push_back(p);
    peers_.clear();
    peers_changed_locked(nullptr);
    for (auto& [id, w] : connect_waits_) {
      w.done = true;
      w.status = reason;
    }
  }
  connect_cv_.notify_all();
  for (auto& p : peers) fail_peer(p, reason);
  {
    std::lock_guard lock(post_mu_);
    std::vector<std::shared_ptr<Job>> all = live_jobs_;
    for (auto& j : all) fail_job_locked(j, reason);
  }
  drain_before_close();
  if (ep_) fi_close(&ep_->fid);
  ep_ = nullptr;
  {
    // Nothing writes into a staging slot any more: drop every job still
    // referenced (ops that never completed, jobs never posted) so that their
    // slots go back before the pool goes. The path's destructor waits for
    // staging copies in flight; their callbacks take post_mu_ and find the
    // jobs failed.
    {
      std::lock_guard lock(post_mu_);
      queue_.clear();
      for (auto& op : ops_) {
        op->job.reset();
        for (auto& j : op->more) j.reset();
      }
    }
    std::unique_ptr<staging::GpuPath> path;
    {
      std::lock_guard lock(gpu_mu_);
      path = std::move(gpu_);
    }
    path.reset();
  }
  {
    std::lock_guard lock(export_mu_);
    for (auto& [id, e] : exported_) {
      for (auto* mr : e.mr) {
        if (mr) fi_close(&mr->fid);
      }
    }
    exported_.clear();
    revoking_.clear();
    for (auto& [id, l] : local_mrs_) fi_close(&l.mr->fid);
    local_mrs_.clear();
    if (staging_mr_) fi_close(&staging_mr_->fid);
    staging_mr_ = nullptr;
    staging_desc_ = nullptr;
  }
  {
    std::lock_guard lock(post_mu_);
    for (auto& op : ops_) {
      if (op->mr) fi_close(&op->mr->fid);
      op->mr = nullptr;
    }
  }
  if (av_) fi_close(&av_->fid);
  if (cq_) fi_close(&cq_->fid);
  if (domain_) fi_close(&domain_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  av_ = nullptr;
  cq_ = nullptr;
  domain_ = nullptr;
  fabric_ = nullptr;
  if (info_) api_.freeinfo(info_);
  info_ = nullptr;
  if (wake_fd_ >= 0) ::close(wake_fd_);
  wake_fd_ = -1;
  // The library stays loaded: providers keep global state (and threads)
  // that must not be unmapped under them.
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
  fi_addr_t addr = FI_ADDR_UNSPEC;
  int n = fi_av_insert(av_, a->name.data(), 1, &addr, 0, nullptr);
  char text[256] = {};
  size_t tlen = sizeof text;
  fi_av_straddr(av_, a->name.data(), text, &tlen);
  if (n != 1) {
    return err::InvalidArgument(
        fmt::format("fabric: cannot insert the peer address {} into the address vector: {}", text,
                    fi_error(n)));
  }
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
  auto pending = std::make_shared<Peer>();
  pending->addr = addr;
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
    return err::PeerDisconnected(
        fmt::format("fabric: peer {} is not connected (lost or never connected)", hex_id(peer)));
  }
  if (p->dead.load()) {
    std::lock_guard plock(p->mu);
    return err::PeerDisconnected(fmt::format("fabric: {}: {}", describe(*p), p->dead_reason));
  }
  return p;
}

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

// --- posting --------------------------------------------------------------------

Op* FabricTransport::take_op() {
  if (free_ops_.empty()) {
    ops_.push_back(std::make_unique<Op>());
    return ops_.back().get();
  }
  Op* op = free_ops_.back();
  free_ops_.pop_back();
  return op;
}

void FabricTransport::give_op(Op* op) {
  op->job.reset();
  for (size_t k = 1; k < op->parts; ++k) op->more[k - 1].reset();
  op->parts = 1;
  op->group = -1;
  op->peer.reset();
  op->bytes = 0;
  op->niov = 0;
  if (!op->mr) op->buf.clear();
  free_ops_.push_back(op);
}

Status FabricTransport::send(const std::shared_ptr<Peer>& p, fi_addr_t addr, MsgType type,
                             uint64_t request, const Bytes& body) {
  Bytes bytes = encode(type, ctx_.engine_id, request, body);
  std::lock_guard lock(post_mu_);
  return send_locked(p, addr, std::move(bytes), nullptr);
}

Status FabricTransport::send_locked(const std::shared_ptr<Peer>& p, fi_addr_t addr, Bytes bytes,
                                    std::shared_ptr<Job> job) {
  if (!ep_ || stop_.load()) return err::Cancelled("fabric: transport shut down");
  Op* op = take_op();
  op->kind = Op::kSend;
  op->peer = p;
  op->job = std::move(job);
  if (op->mr) {
    fi_close(&op->mr->fid);
    op->mr = nullptr;
  }
  op->buf = std::move(bytes);
  if (mr_mode_ & FI_MR_LOCAL) {
    int r = fi_mr_reg(domain_, op->buf.data(), op->buf.size(), FI_SEND, 0, next_key_.fetch_add(1),
                      0, &op->mr, nullptr);
    if (r != 0) {
      give_op(op);
      return err::Internal("fabric: registering a send buffer: " + fi_error(r));
    }
  }
  op->to = addr;  // kept for a retry after FI_EAGAIN
  // Per peer in order: behind a message to the same peer still waiting for
  // room, never behind another peer's (a dead peer must not block the rest).
  if (std::any_of(send_queue_.begin(), send_queue_.end(),
                  [addr](const Op* q) { return q->to == addr; })) {
    send_queue_.push_back(op);
    wake(/*urgent=*/true);
    return Status::Ok();
  }
  struct iovec iov {
    op->buf.data(), op->buf.size()
  };
  void* desc = op->mr ? fi_mr_desc(op->mr) : nullptr;
  struct fi_msg msg {};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = addr;
  msg.context = &op->ctx;
  ssize_t r =
      fi_sendmsg(ep_, &msg, FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0));
  if (r == -FI_EAGAIN) {
    send_queue_.push_back(op);
    wake(/*urgent=*/true);
    return Status::Ok();
  }
  if (r != 0) {
    give_op(op);
    return err::PeerDisconnected(fmt::format("fabric: {}: fi_send: {}",
                                             p ? describe(*p) : std::string("peer"),
                                             fi_error(static_cast<int>(r))));
  }
  return Status::Ok();
}

Status FabricTransport::post(PeerId peer, const std::shared_ptr<Transfer>& t,
                             std::vector<Segment>& segments, bool write) {
  auto p = live_peer(peer);
  if (!p.ok()) return p.status();
  if (write && t->has_notification && t->notification.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes exceeds the limit of {}",
                                            t->notification.size(), kMaxNotificationBytes));
  }
  // Core routes the peer's GPU memory here only where the peer has FI_HMEM
  // (capabilities_for); local GPU memory is direct under FI_HMEM, else staged.
  bool staged = false, gpu_direct = false;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.remote_device >= 0 && !(*p)->hmem) {
      return err::NotSupported(fmt::format(
          "fabric: {} iov {}: region {} of {} is GPU memory, and the peer does not register GPU "
          "memory with FI_HMEM: it cannot be reached one-sided (tcp carries it)",
          write ? "write" : "read", i, s.remote.region_id, describe(**p)));
    }
    if (s.local_device >= 0) (hmem_ ? gpu_direct : staged) = true;
  }
  // From the per-thread block cache (core/block_cache.h): no malloc per call.
  auto job = std::allocate_shared<Job>(BlockCacheAllocator<Job>());
  job->transfer = t;
  job->peer = *p;
  job->write = write;
  job->segs = std::move(segments);
  if (staged) {
    auto path = gpu();
    if (!path.ok()) return path.status();
    if (Status s = plan_staging(*job, *path); !s.ok()) return s;
    if (!write) {
      // The landing copies come when the data is in: they run after what the
      // caller queued on the default stream before this call, and nothing later.
      std::vector<int> devices;
      for (const Segment& s : job->segs) {
        if (s.local_device >= 0) devices.push_back(s.local_device);
      }
      auto mark = DefaultStreamMark::take(devices);
      if (!mark.ok()) return mark.status();
      job->after = std::move(mark.value());
    }
  }
  JobSegments& segs = job->segs;
  if (segs.size() > 1) job->more_keys.resize(segs.size());
  if ((mr_mode_ & FI_MR_LOCAL) || gpu_direct) job->descs.resize(segs.size());
  bool handed_over = false;  // every op of the job is with the provider
  const uint64_t revoke_gen = (*p)->revoke_gen.load();
  // Keys: one request per descriptor the first time, then a cache hit; a run
  // of segments on one descriptor looks it up once.
  const RemoteAccessRequest* last = nullptr;
  RemoteKey last_key;
  for (size_t i = 0; i < segs.size(); ++i) {
    const RemoteAccessRequest& r = segs[i].remote;
    if (!last || key_of(*last) != key_of(r)) {
      auto k = grant_for(*p, r, revoke_gen);
      if (!k.ok()) {
        // Refusals are the transfer's result, as tcp reports them.
        t->complete(k.status());
        return Status::Ok();
      }
      last_key = *k;
      last = &r;
    }
    job->key(i) = {last_key.mr_key, last_key.base + r.adv_offset + r.offset};
    if (job->descs.empty()) continue;
    if (!job->group_of.empty() && job->group_of[i] >= 0) {
      job->descs[i] = staging_desc_;  // the pool's registration
    } else if ((mr_mode_ & FI_MR_LOCAL) || segs[i].local_device >= 0) {
      auto d = local_desc(segs[i]);
      if (!d.ok()) return d.status();
      job->descs[i] = *d;
    }
  }
  {
    std::lock_guard lock(post_mu_);
    if ((*p)->dead.load()) {
      std::lock_guard plock((*p)->mu);
      return err::PeerDisconnected(fmt::format("fabric: {}: {}", describe(**p), (*p)->dead_reason));
    }
    if ((*p)->revoke_gen != revoke_gen) {
      // A REVOKE came while the keys were looked up: none may be used.
      std::unordered_set<RegionId> gone;
      {
        std::lock_guard plock((*p)->mu);
        gone = (*p)->revoked;
      }
      for (const Segment& s : job->segs) {
        if (gone.count(s.remote.region_id)) {
          t->complete(revoked_error(**p, s.remote.region_id));
          return Status::Ok();
        }
      }
    }
    add_live_locked(job);
    if (queue_.empty() && send_queue_.empty() && job->groups.empty() && !held_for_combining(*job)) {
      // Nothing waits before it: posted here, without a round through queue_
      // (what the window or the provider leaves joins it).
      while (!job->stopped && job->next < segs.size() && inflight_ < opt_.max_inflight &&
             inflight_bytes_ < opt_.max_inflight_bytes && post_one_locked(*job, job)) {
      }
      if (!job->stopped && job->next < segs.size()) {
        queue_.push_back(job);
        backlog_.store(true, std::memory_order_relaxed);
      }
    } else {
      queue_.push_back(job);
      pump_locked();
    }
    maybe_finish_locked(job);
    // A job held for combining needs no wake-up either: the completion of
    // one of its peer's ops in flight pumps it.
    const bool held = held_for_combining(*job);
    counts_.held_calls += held;
    handed_over = job->finished || job->stopped ||
                  (job->next >= job->segs.size() && job->groups.empty() && send_queue_.empty()) ||
                  held;
  }
  if (!job->groups.empty()) start_staging(job);
  // Nobody will poll the CQ for a transfer this large (core's wait() sleeps
  // at once): a progress thread napping behind a waiter's lease takes the CQ
  // back now.
  // (The lease is cleared whatever the thread is doing: one about to
  // decide to nap would otherwise still see it.)
  const bool unpolled = t->bytes > kPolledMaxBytes;
  if (unpolled) waiter_polled_ns_.store(0, std::memory_order_relaxed);
  // A small transfer handed to the provider whole needs nothing from the
  // progress thread: a waiter polls for it, and a progress thread asleep on
  // the CQ's wait fd is woken by the provider when it completes. Waking it
  // anyway cost an eventfd write per call and, once the progress thread had
  // taken the CQ (a loaded machine, a wait past engine.wait_spin_us), a
  // context switch per call (0.7 eventfd writes per 4 KiB write measured).
  // Without a wait fd the thread naps 1 ms at a time: then it is woken.
  if (unpolled || !handed_over || cq_fd_ < 0) wake(unpolled);
  return Status::Ok();
}

// --- GPU staging ------------------------------------------------------------------

Result<staging::GpuPath*> FabricTransport::gpu() {
  std::lock_guard lock(gpu_mu_);
  if (gpu_) return gpu_.get();
  if (!gpu_error_.ok()) return gpu_error_;
  staging::GpuPathOptions o;
  o.staging_bytes = opt_.gpu_staging_bytes;
  o.slot_bytes = std::min(kStagingSlotBytes, max_op_bytes_);
  o.user = "fabric";
  auto created = staging::GpuPath::create(o, "ferry-fab");
  if (!created.ok()) {
    gpu_error_ = created.status();
    return gpu_error_;
  }
  // The pool is registered once, as a whole: every slot lies in it.
  if (mr_mode_ & FI_MR_LOCAL) {
    auto [base, bytes] = (*created)->staging_memory();
    const int r = register_mr(base, bytes, FI_READ | FI_WRITE, -1, &staging_mr_);
    if (r != 0) {
      gpu_error_ = err::Internal(fmt::format(
          "fabric: registering the {} bytes of GPU staging memory: {}", bytes, fi_error(r)));
      return gpu_error_;
    }
    staging_desc_ = fi_mr_desc(staging_mr_);
  }
  spdlog::info(
      "ferry: fabric: local GPU memory staged through {} MiB of pinned memory ({} KiB "
      "slots; no FI_HMEM)",
      opt_.gpu_staging_bytes >> 20, o.slot_bytes >> 10);
  gpu_ = std::move(created.value());
  return gpu_.get();
}

Status FabricTransport::plan_staging(Job& job, staging::GpuPath* path) {
  const uint64_t slot = path->slot_bytes();
  std::vector<Segment> out;
  out.reserve(job.segs.size());
  for (const Segment& s : job.segs) {
    if (s.local_device < 0 || s.length <= slot) {
      out.push_back(s);
      continue;
    }
    for (uint64_t off = 0; off < s.length; off += slot) {
      Segment piece = s;
      piece.local = s.local + off;
      piece.length = std::min(slot, s.length - off);
      piece.remote.offset = s.remote.offset + off;
      piece.remote.length = piece.length;
      out.push_back(piece);
    }
  }
  job.segs = std::move(out);
  job.group_of.assign(job.segs.size(), -1);
  job.slot_off.assign(job.segs.size(), 0);
  for (size_t i = 0; i < job.segs.size(); ++i) {
    const Segment& s = job.segs[i];
    if (s.local_device < 0) continue;
    if (job.groups.empty() || job.groups.back().bytes + s.length > slot) {
      job.groups.emplace_back();
      job.groups.back().first = i;
    }
    StageGroup& g = job.groups.back();
    job.group_of[i] = static_cast<int32_t>(job.groups.size() - 1);
    job.slot_off[i] = g.bytes;
    g.bytes += s.length;
    g.left = g.bytes;
    g.last = i;
  }
  return Status::Ok();
}

void FabricTransport::start_staging(const std::shared_ptr<Job>& job) {
  staging::GpuPath* path;
  {
    std::lock_guard lock(gpu_mu_);
    path = gpu_.get();
  }
  if (!path) return;  // shut down: the job has failed
  // One request per group, in order: the pool serves waiters in request
  // order, so a transfer larger than the pool flows through it as its
  // earlier groups give their slots back.
  for (size_t g = 0; g < job->groups.size(); ++g) {
    auto slot = path->slot_or_later(
        [this, job, g](std::unique_ptr<StagingSlot> later) { on_slot(job, g, std::move(later)); });
    if (slot) on_slot(job, g, std::move(slot));
  }
}

void FabricTransport::on_slot(const std::shared_ptr<Job>& job, size_t g,
                              std::unique_ptr<StagingSlot> slot) {
  std::vector<staging::DeviceCopy> copies;
  {
    std::lock_guard lock(post_mu_);
    if (job->stopped || job->finished) return;  // the slot goes back
    StageGroup& group = job->groups[g];
    group.slot = std::move(slot);
    if (!job->write) {
      group.ready = true;  // a read lands in the slot
      pump_locked();
    } else {
      for (size_t i = group.first; i <= group.last; ++i) {
        if (job->group_of[i] != static_cast<int32_t>(g)) continue;
        const Segment& s = job->segs[i];
        copies.push_back(
            {s.local_device, {group.slot->data() + job->slot_off[i], s.local, s.length}});
      }
      ++job->copies;
    }
  }
  if (copies.empty()) {
    wake();
    return;
  }
  staging::GpuPath* path;
  {
    std::lock_guard lock(gpu_mu_);
    path = gpu_.get();
  }
  auto done = [this, job, g](Status st) {
    {
      std::lock_guard lock(post_mu_);
      --job->copies;
      if (!st.ok()) {
        stop_staged_job_locked(*job, st,
                               fmt::format("staging {} bytes of GPU memory for the write to {}",
                                           job->groups[g].bytes, describe(*job->peer)));
      } else {
        job->groups[g].ready = true;
        pump_locked();
      }
      maybe_finish_locked(job);
      notify_job_waiters_locked();
    }
    wake();
  };
  if (!path) {
    done(err::Cancelled("fabric: transport shut down"));
    return;
  }
  // The write's source: after what the caller queued on the default stream.
  path->copy_then(std::move(copies), std::move(done), /*after_default_stream=*/true);
}

void FabricTransport::group_done_locked(const std::shared_ptr<Job>& job, size_t g,
                                        const Status& error) {
  StageGroup& group = job->groups[g];
  if (job->write || !error.ok() || job->stopped || !job->error.ok()) {
    group.slot.reset();  // back to the pool (a waiter gets it on the job thread)
    return;
  }
  // A read: every byte of the group is in the slot; slot → device, then the
  // slot goes back. The copy is submitted from the staging job thread (this
  // one holds post_mu_, which the copy's completion takes).
  std::vector<staging::DeviceCopy> copies;
  for (size_t i = group.first; i <= group.last; ++i) {
    if (job->group_of[i] != static_cast<int32_t>(g)) continue;
    const Segment& s = job->segs[i];
    copies.push_back({s.local_device, {s.local, group.slot->data() + job->slot_off[i], s.length}});
  }
  staging::GpuPath* path;
  {
    std::lock_guard gpu_lock(gpu_mu_);  // after post_mu_, never before it
    path = gpu_.get();
  }
  if (!path) {
    group.slot.reset();
    return;
  }
  ++job->copies;
  path->run([this, job, g, path, copies = std::move(copies)]() mutable {
    path->copy_then(
        std::move(copies),
        [this, job, g](Status st) {
          {
            std::lock_guard lock(post_mu_);
            --job->copies;
            job->groups[g].slot.reset();
            if (!st.ok()) {
              stop_staged_job_locked(*job, st,
                                     fmt::format("copying {} bytes read from {} into GPU memory",
                                                 job->groups[g].bytes, describe(*job->peer)));
            }
            maybe_finish_locked(job);
            notify_job_waiters_locked();
          }
          wake();
        },
        /*after_default_stream=*/false, job->after);
  });
}

bool FabricTransport::staged_waiting_locked(const Job& job) const {
  if (job.group_of.empty() || job.next >= job.segs.size()) return false;
  const int32_t g = job.group_of[job.next];
  return g >= 0 && !job.groups[static_cast<size_t>(g)].ready;
}

Status FabricTransport::post_write(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                   std::vector<Segment> segments) {
  return post(peer, transfer, segments, true);
}

Status FabricTransport::post_read(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                  std::vector<Segment> segments) {
  return post(peer, transfer, segments, false);
}

Status FabricTransport::post_notification(PeerId peer, const std::shared_ptr<Transfer>& transfer,
                                          Bytes payload) {
  if (payload.size() > kMaxNotificationBytes) {
    return err::InvalidArgument(fmt::format("notification of {} bytes exceeds the limit of {}",
                                            payload.size(), kMaxNotificationBytes));
  }
  transfer->notification = std::move(payload);
  transfer->has_notification = true;
  std::vector<Segment> none;
  return post(peer, transfer, none, true);
}

// Posts one operation of `job`: consecutive segments under one key, several
// local iovs, and as many remote ranges as the provider takes per operation
// (rma_iov_limit; a segment that continues the previous remote range extends
// it); false when the window or the provider is full.
bool FabricTransport::post_one_locked(Job& job, const std::shared_ptr<Job>& ref) {
  Op* op = take_op();
  op->kind = Op::kRma;
  size_t i = job.next;
  uint64_t off = job.next_off;
  uint64_t total = 0;
  const uint64_t key = job.key(i).mr_key;
  size_t nrma = 1;
  op->rma[0] = {job.key(i).base + off, 0, key};
  // Staged pieces: one op never mixes groups (a group's slot goes back when
  // its bytes completed) nor splits a piece (each fits one op).
  auto group_at = [&job](size_t k) { return job.group_of.empty() ? -1 : job.group_of[k]; };
  const int32_t group = group_at(i);
  op->group = group;
  op->niov = 0;
  size_t end_i = i;
  uint64_t end_off = off;
  while (end_i < job.segs.size() && op->niov < iov_limit_) {
    const Segment& s = job.segs[end_i];
    if (op->niov > 0) {
      if (job.key(end_i).mr_key != key || group_at(end_i) != group ||
          (group >= 0 && s.length > max_op_bytes_ - total)) {
        break;
      }
      const struct fi_rma_iov& last = op->rma[nrma - 1];
      if (job.key(end_i).base != last.addr + last.len) {
        if (nrma == rma_iov_limit_) break;
        op->rma[nrma++] = {job.key(end_i).base, 0, key};
      }
    }
    const uint64_t take = std::min<uint64_t>(s.length - end_off, max_op_bytes_ - total);
    op->rma[nrma - 1].len += take;
    op->iov[op->niov].iov_base = group >= 0 ? job.groups[static_cast<size_t>(group)].slot->data() +
                                                  job.slot_off[end_i] + end_off
                                            : s.local + end_off;
    op->iov[op->niov].iov_len = take;
    op->desc[op->niov] = job.descs.empty() ? nullptr : job.descs[end_i];
    ++op->niov;
    total += take;
    end_off += take;
    if (end_off == s.length) {
      ++end_i;
      end_off = 0;
    }
    if (total == max_op_bytes_) break;
  }
  op->bytes = total;
  op->remote_region = job.segs[i].remote.region_id;
  struct fi_msg_rma msg {};
  msg.msg_iov = op->iov;
  msg.desc = job.descs.empty() ? nullptr : op->desc;
  msg.iov_count = op->niov;
  msg.addr = job.peer->addr;
  msg.rma_iov = op->rma;
  msg.rma_iov_count = nrma;
  msg.context = &op->ctx;
  const ssize_t r = submit_rma(msg, job.write);
  if (r == -FI_EAGAIN) {
    give_op(op);
    return false;
  }
  if (r != 0) {
    give_op(op);
    job.stopped = true;
    if (job.error.ok()) {
      job.error = err::PeerDisconnected(
          fmt::format("fabric: {}: posting {} of {} bytes to region {}: {}", describe(*job.peer),
                      job.write ? "a write" : "a read", total, job.segs[i].remote.region_id,
                      fi_error(static_cast<int>(r))));
    }
    return false;
  }
  op->job = ref;
  job.next = end_i;
  job.next_off = end_off;
  ++job.posted;
  note_posted_locked(*job.peer, total);
  return true;
}

ssize_t FabricTransport::submit_rma(const struct fi_msg_rma& msg, bool write) {
  return write ? fi_writemsg(ep_, &msg,
                             FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0))
               : fi_readmsg(ep_, &msg, FI_COMPLETION);
}

void FabricTransport::note_posted_locked(Peer& p, uint64_t bytes) {
  ++inflight_;
  inflight_bytes_ += bytes;
  ++p.inflight_ops;
  ++counts_.rma_ops;
}

std::vector<std::pair<std::string, uint64_t>> FabricTransport::counters() const {
  std::lock_guard lock(post_mu_);
  return {{"rma_ops", counts_.rma_ops},
          {"combined_ops", counts_.combined_ops},
          {"combined_calls", counts_.combined_calls},
          {"held_calls", counts_.held_calls}};
}

bool FabricTransport::combinable(const Job& job) const {
  return combine_limit_ > 1 && job.segs.size() == 1 && job.next == 0 && job.next_off == 0 &&
         !job.stopped && job.groups.empty() && job.segs[0].local_device < 0 &&
         job.segs[0].length > 0 && job.segs[0].length <= opt_.combine_max_bytes;
}

bool FabricTransport::held_for_combining(const Job& job) const {
  return combinable(job) && job.peer->inflight_ops >= opt_.combine_after &&
         (job.hold_until == 0 || job.peer->completed_ops < job.hold_until);
}

bool FabricTransport::post_combined_locked(const std::shared_ptr<Job>* parts, size_t n) {
  Job& first = *parts[0];
  Op* op = take_op();
  op->kind = Op::kRma;
  op->group = -1;
  op->niov = n;
  uint64_t total = 0;
  for (size_t k = 0; k < n; ++k) {
    Job& j = *parts[k];
    const Segment& s = j.segs[0];
    op->iov[k].iov_base = s.local;
    op->iov[k].iov_len = s.length;
    op->desc[k] = j.descs.empty() ? nullptr : j.descs[0];
    op->rma[k].addr = j.key(0).base;
    op->rma[k].len = s.length;
    op->rma[k].key = j.key(0).mr_key;
    total += s.length;
  }
  op->bytes = total;
  op->remote_region = first.segs[0].remote.region_id;
  struct fi_msg_rma msg {};
  msg.msg_iov = op->iov;
  msg.desc = first.descs.empty() ? nullptr : op->desc;
  msg.iov_count = n;
  msg.addr = first.peer->addr;
  msg.rma_iov = op->rma;
  msg.rma_iov_count = n;
  msg.context = &op->ctx;
  const ssize_t r = submit_rma(msg, first.write);
  if (r == -FI_EAGAIN) {
    give_op(op);
    return false;
  }
  if (r != 0) {
    give_op(op);
    for (size_t k = 0; k < n; ++k) {
      Job& j = *parts[k];
      j.stopped = true;
      if (j.error.ok()) {
        j.error = err::PeerDisconnected(fmt::format(
            "fabric: {}: posting {} of {} bytes to region {} (combined with {} other small "
            "operations): {}",
            describe(*j.peer), j.write ? "a write" : "a read", j.segs[0].length,
            j.segs[0].remote.region_id, n - 1, fi_error(static_cast<int>(r))));
      }
    }
    return false;
  }
  op->job = parts[0];
  op->parts = n;
  for (size_t k = 0; k < n; ++k) {
    Job& j = *parts[k];
    if (k > 0) op->more[k - 1] = parts[k];
    j.next = 1;
    ++j.posted;
  }
  note_posted_locked(*first.peer, total);
  ++counts_.combined_ops;
  counts_.combined_calls += n;
  return true;
}

void FabricTransport::pump_locked() {
  if (!ep_) return;
  // Control messages first, in order per peer; a peer whose queue is full
  // (FI_EAGAIN) holds back only its own messages and operations.
  std::vector<fi_addr_t> blocked;
  auto is_blocked = [&blocked](fi_addr_t a) {
    return std::find(blocked.begin(), blocked.end(), a) != blocked.end();
  };
  for (auto it = send_queue_.begin(); it != send_queue_.end();) {
    Op* op = *it;
    if (is_blocked(op->to)) {
      ++it;
      continue;
    }
    struct iovec iov {
      op->buf.data(), op->buf.size()
    };
    void* desc = op->mr ? fi_mr_desc(op->mr) : nullptr;
    struct fi_msg msg {};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = op->to;
    msg.context = &op->ctx;
    ssize_t r =
        fi_sendmsg(ep_, &msg, FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0));
    if (r == -FI_EAGAIN) {
      blocked.push_back(op->to);
      ++it;
      continue;
    }
    it = send_queue_.erase(it);
    if (r != 0) {
      on_completion(op, err::PeerDisconnected("fabric: fi_send: " + fi_error(static_cast<int>(r))));
    }
  }
  // Jobs held for combining are not backlog: a completion pumps them.
  bool backlog = false;
  std::shared_ptr<Job> parts[Op::kMaxIov];
  for (auto it = queue_.begin(); it != queue_.end();) {
    std::shared_ptr<Job> job = *it;
    if (job->stopped || job->next >= job->segs.size()) {
      it = queue_.erase(it);
      maybe_finish_locked(job);
      continue;
    }
    if (inflight_ >= opt_.max_inflight || inflight_bytes_ >= opt_.max_inflight_bytes) {
      backlog = true;
      break;
    }
    if (is_blocked(job->peer->addr) || staged_waiting_locked(*job)) {
      backlog = true;
      ++it;  // a staged group still waits for its slot or copy: not the peer's fault
      continue;
    }
    if (combinable(*job)) {
      // Company from the jobs queued behind it: same peer, direction and
      // remote region (a refused key fails only what asked for it).
      size_t n = 1;
      parts[0] = job;
      uint64_t bytes = job->segs[0].length;
      size_t looked = 0;
      for (auto jt = std::next(it);
           jt != queue_.end() && n < combine_limit_ && looked < 4 * combine_limit_;
           ++jt, ++looked) {
        const Job& o = **jt;
        if (o.peer != job->peer || o.write != job->write || !combinable(o) ||
            o.segs[0].remote.region_id != job->segs[0].remote.region_id ||
            o.key(0).mr_key != job->key(0).mr_key || o.descs.empty() != job->descs.empty() ||
            bytes + o.segs[0].length > max_op_bytes_) {
          continue;
        }
        parts[n++] = *jt;
        bytes += o.segs[0].length;
      }
      const bool hold = n < combine_limit_ && held_for_combining(*job);
      if (hold && job->hold_until == 0) job->hold_until = job->peer->completed_ops + 1;
      bool posted = false;
      if (!hold && n > 1) posted = post_combined_locked(parts, n);
      for (size_t k = 0; k < n; ++k) parts[k].reset();
      if (hold) {
        ++it;
        continue;
      }
      if (n > 1) {
        if (!posted && !job->stopped) {
          blocked.push_back(job->peer->addr);  // FI_EAGAIN: retried after completions
          backlog = true;
          ++it;
        }
        continue;
      }
    }
    if (!post_one_locked(*job, job) && !job->stopped) {
      blocked.push_back(job->peer->addr);  // FI_EAGAIN: retried after completions
      backlog = true;
      ++it;
    }
  }
  backlog_.store(!send_queue_.empty() || backlog, std::memory_order_relaxed);
}

void FabricTransport::add_live_locked(const std::shared_ptr<Job>& job) {
  job->live_index = live_jobs_.size();
  job->transfer->transport_state = job.get();
  live_jobs_.push_back(job);
}

void FabricTransport::remove_live_locked(Job& job) {
  // The last one takes its place.
  const size_t i = job.live_index;
  job.transfer->transport_state = nullptr;
  if (i + 1 != live_jobs_.size()) {
    live_jobs_[i] = std::move(live_jobs_.back());
    live_jobs_[i]->live_index = i;
  }
  live_jobs_.pop_back();
}

void FabricTransport::stop_staged_job_locked(Job& job, const Status& s, const std::string& what) {
  job.stopped = true;
  if (job.error.ok()) {
    job.error = Status(s.code(), fmt::format("fabric: {}: {}", what, s.message()));
  }
}

void FabricTransport::fail_job_locked(const std::shared_ptr<Job>& job, const Status& s) {
  job->stopped = true;
  if (job->error.ok()) job->error = s;
  if (!job->finished) {
    job->finished = true;
    job->transfer->complete(job->error);
    remove_live_locked(*job);
  }
  notify_job_waiters_locked();
}

void FabricTransport::notify_job_waiters_locked() {
  if (job_waiters_ > 0) job_cv_.notify_all();
}

void FabricTransport::maybe_finish_locked(const std::shared_ptr<Job>& job) {
  if (job->finished) return;
  const bool all_posted = job->stopped || job->next >= job->segs.size();
  if (!all_posted || job->done != job->posted || job->copies != 0) return;
  if (!job->error.ok()) {
    fail_job_locked(job, job->error);
    return;
  }
  Transfer& t = *job->transfer;
  if (job->write && t.has_notification && !job->notify_posted) {
    // Every RMA op of the write has completed (delivery-complete: placed at
    // the target), so the notification cannot overtake the data.
    job->notify_posted = true;
    Status s = send_locked(job->peer, job->peer->addr,
                           encode(MsgType::kNotify, ctx_.engine_id, t.id(), t.notification), job);
    if (!s.ok()) fail_job_locked(job, s);
    return;
  }
  if (job->write && t.has_notification) return;  // waits for the NOTIFY send
  job->finished = true;
  t.complete(Status::Ok());
  remove_live_locked(*job);
  notify_job_waiters_locked();
}

void FabricTransport::cancel(Transfer& transfer) {
  std::unique_lock lock(post_mu_);
  if (!transfer.transport_state) return;
  std::shared_ptr<Job> job = live_jobs_[static_cast<Job*>(transfer.transport_state)->live_index];
  job->stopped = true;
  if (job->error.ok()) {
    job->error = err::Cancelled(fmt::format("transfer {} was cancelled", transfer.id()));
  }
  // Ops already handed to the provider cannot be called back: wait until they
  // complete (or the peer is declared dead, which bounds the wait).
  ++job_waiters_;
  job_cv_.wait_for(lock, opt_.peer_timeout + std::chrono::seconds(1), [&] {
    return (job->done == job->posted || job->peer->dead.load()) && job->copies == 0;
  });
  --job_waiters_;
  maybe_finish_locked(job);
}

// --- progress -------------------------------------------------------------------

void FabricTransport::wake(bool urgent) {
  if (wake_fd_ < 0) return;
  work_gen_.fetch_add(1);
  if (urgent) urgent_gen_.fetch_add(1);
  // Out of a waiter's way, the progress thread needs waking only for what
  // the waiter leaves to it; new ops are moved by the waiter's polling.
  const Sleep state = sleeping_.load();
  if (state == Sleep::kAwake || (state == Sleep::kWaiterPolls && !urgent)) return;
  uint64_t one = 1;
  [[maybe_unused]] auto w = ::write(wake_fd_, &one, sizeof one);
}

void FabricTransport::on_completion(Op* op, const Status& error) {
  // post_mu_ held.
  if (op->kind == Op::kRma) {
    --inflight_;
    inflight_bytes_ -= op->bytes;
    const RegionId region = op->remote_region;
    if (op->parts > 1) {
      std::shared_ptr<Job> jobs[Op::kMaxIov];
      uint64_t lengths[Op::kMaxIov];
      const size_t n = op->parts;
      for (size_t k = 0; k < n; ++k) {
        jobs[k] = k == 0 ? std::move(op->job) : std::move(op->more[k - 1]);
        lengths[k] = op->iov[k].iov_len;
      }
      give_op(op);
      if (jobs[0]) note_completed(*jobs[0]->peer);
      for (size_t k = 0; k < n; ++k) {
        if (jobs[k]) rma_done_locked(std::move(jobs[k]), region, -1, lengths[k], error);
      }
      return;
    }
    std::shared_ptr<Job> job = std::move(op->job);
    const int32_t group = op->group;
    const uint64_t bytes = op->bytes;
    give_op(op);
    if (!job) return;
    note_completed(*job->peer);
    rma_done_locked(std::move(job), region, group, bytes, error);
    return;
  }
  if (op->kind == Op::kSend) {
    std::shared_ptr<Job> job = std::move(op->job);
    give_op(op);
    if (!job) return;
    if (!error.ok()) {
      fail_job_locked(job, error);
      return;
    }
    job->finished = true;
    job->transfer->complete(Status::Ok());
    remove_live_locked(*job);
    notify_job_waiters_locked();
  }
}

void FabricTransport::rma_done_locked(std::shared_ptr<Job> job, RegionId region, int32_t group,
                                      uint64_t bytes, const Status& error) {
  ++job->done;
  if (group >= 0) {
    StageGroup& g = job->groups[static_cast<size_t>(group)];
    g.left -= std::min(g.left, bytes);
    // Only once none of its ops is in flight may the slot go back (a
    // stopped job's unposted pieces keep it until the job is dropped).
    if (g.left == 0) group_done_locked(job, static_cast<size_t>(group), error);
  }
  if (!error.ok()) {
    job->stopped = true;
    if (job->error.ok()) {
      bool revoked = false;
      {
        std::lock_guard plock(job->peer->mu);
        revoked = job->peer->revoked.count(region) > 0;
      }
      job->error = revoked
                       ? err::NotFound(fmt::format(
                             "fabric: region {} on {} was deregistered during the {}: {}", region,
                             describe(*job->peer), job->write ? "write" : "read", error.message()))
                       : error;
    }
  }
  maybe_finish_locked(job);
  notify_job_waiters_locked();
  if (!acks_due_.empty()) send_due_acks_locked();
}

void FabricTransport::handle_entry(const struct fi_cq_data_entry& e) {
  Op* op = static_cast<Op*>(e.op_context);
  if (!op) return;
  if (op->kind == Op::kRecv) {
    on_message(op->buf.data(), e.len);
    std::lock_guard lock(post_mu_);
    if (ep_ && !stop_.load()) {
      if (Status s = post_recv(op); !s.ok()) spdlog::error("ferry: {}", s.message());
    }
    return;
  }
  std::lock_guard lock(post_mu_);
  on_completion(op, Status::Ok());
}

size_t FabricTransport::read_cq_error_locked() {
  struct fi_cq_err_entry e {};
  char buf[256] = {};
  if (fi_cq_readerr(cq_, &e, 0) < 0) return 0;
  Op* op = static_cast<Op*>(e.op_context);
  const char* text = fi_cq_strerror(cq_, e.prov_errno, e.err_data, buf, sizeof buf);
  if (!op) return 1;
  if (op->kind == Op::kRecv) {
    if (e.err == FI_ECANCELED && stop_.load()) return 1;
    spdlog::warn("ferry: fabric: a receive failed: {} ({})", text ? text : "?", fi_error(e.err));
    std::lock_guard lock(post_mu_);
    if (ep_ && !stop_.load()) (void)post_recv(op);
    return 1;
  }
  // The connection to the peer is gone: every other transfer to it fails
  // now too and the engine hears of it, rather than at the keepalive deadline.
  std::shared_ptr<Peer> lost;
  Status st = [&] {
    std::lock_guard lock(post_mu_);
    const std::string who = op->job    ? describe(*op->job->peer)
                            : op->peer ? describe(*op->peer)
                                       : std::string("a peer");
    const std::string what = op->kind == Op::kRma
                                 ? fmt::format("{} of {} bytes on region {}",
                                               op->job && op->job->write ? "write" : "read",
                                               op->bytes, op->remote_region)
                                 : "message";
    std::string msg = fmt::format("fabric: {} to {} failed: {} (provider: {})", what, who,
                                  fi_error(e.err), text ? text : "?");
    Status why;
    if (op->kind == Op::kRma &&
        (e.prov_errno == ENOENT || e.err == FI_EKEYREJECTED || e.err == FI_EACCES)) {
      // The target's provider no longer knows the key: the region was
      // deregistered while the op was on its way (its REVOKE may still be
      // behind this completion).
      why = err::NotFound(
          fmt::format("fabric: region {} on {} refused the {} (deregistered while in flight?): {} "
                      "(provider: {})",
                      op->remote_region, who, op->job && op->job->write ? "write" : "read",
                      fi_error(e.err), text ? text : "?"));
    } else if (is_disconnect(e.err)) {
      why = err::PeerDisconnected(std::move(msg));
      lost = op->job ? op->job->peer : op->peer;
    } else {
      why = err::Internal(std::move(msg));
    }
    on_completion(op, why);
    return why;
  }();
  if (lost) fail_peer(lost, st);
  return 1;
}

size_t FabricTransport::drain_cq_locked(bool read_cq) {
  size_t handled = 0;
  while (!deferred_.empty()) {
    const struct fi_cq_data_entry e = deferred_.front();
    deferred_.pop_front();
    handle_entry(e);
    ++handled;
  }
  if (!read_cq) return handled;
  struct fi_cq_data_entry entries[kCqBatch];
  ssize_t n = fi_cq_read(cq_, entries, kCqBatch);
  if (n > 0) {
    // Completions in a row are handled under one post_mu_ (a message takes
    // it on its own, after on_message).
    for (ssize_t i = 0; i < n;) {
      const Op* first = static_cast<const Op*>(entries[i].op_context);
      if (first && first->kind == Op::kRecv) {
        handle_entry(entries[i++]);
        continue;
      }
      std::lock_guard lock(post_mu_);
      for (; i < n; ++i) {
        Op* op = static_cast<Op*>(entries[i].op_context);
        if (op && op->kind == Op::kRecv) break;
        if (op) on_completion(op, Status::Ok());
      }
    }
    return handled + static_cast<size_t>(n);
  }
  if (n == -FI_EAVAIL) return handled + read_cq_error_locked();
  if (n != -FI_EAGAIN) {
    spdlog::error("ferry: fabric: fi_cq_read: {}", fi_error(static_cast<int>(n)));
  }
  return handled;
}

void FabricTransport::progress(const Transfer& /*transfer*/) {
  // A waiter reads the CQ only when nobody else does and nothing read
  // earlier is still put aside (entries are handled in the order read).
  waiter_polled_ns_.store(now_ns(), std::memory_order_relaxed);
  std::unique_lock cq(cq_mu_, std::try_to_lock);
  if (!cq.owns_lock() || !deferred_.empty() || stop_.load() || !cq_) return;
  struct fi_cq_data_entry entries[kCqBatch];
  ssize_t n = fi_cq_read(cq_, entries, kCqBatch);
  if (n == -FI_EAVAIL) {
    // Errors are the progress thread's: one may declare a peer dead, which
    // calls into the engine.
    error_pending_.store(true);
    wake(/*urgent=*/true);
    return;
  }
  if (n <= 0) return;
  bool put_aside = false;
  {
    std::lock_guard lock(post_mu_);
    for (ssize_t i = 0; i < n; ++i) {
      Op* op = static_cast<Op*>(entries[i].op_context);
      // A message is handled by the progress thread (it may call into the
      // engine); so is every entry after it, to keep the order.
      if (put_aside || (op && op->kind == Op::kRecv)) {
        put_aside = true;
        deferred_.push_back(entries[i]);
        deferred_pending_.store(true);
        continue;
      }
      if (op) on_completion(op, Status::Ok());
    }
    pump_locked();
  }
  if (put_aside) wake(/*urgent=*/true);
}

void FabricTransport::drain_before_close() {
  // Closing tcp;ofi_rxm's endpoint with hundreds of MiB of RMA still posted
  // once crashed inside libfabric: give what is posted a moment to complete
  // (or fail) first. Only completions are counted; messages that arrive are
  // dropped (the engine is going away). Bounded: a dead peer's ops never end.
  if (!cq_) return;
  const auto until = Clock::now() + std::chrono::milliseconds(500);
  struct fi_cq_data_entry entries[kCqBatch];
  while (Clock::now() < until) {
    {
      std::lock_guard lock(post_mu_);
      if (inflight_ == 0) return;
    }
    ssize_t n = fi_cq_read(cq_, entries, kCqBatch);
    if (n == -FI_EAVAIL) {
      struct fi_cq_err_entry e {};
      if (fi_cq_readerr(cq_, &e, 0) <= 0) continue;
      entries[0].op_context = e.op_context;
      n = 1;
    }
    if (n <= 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      continue;
    }
    std::lock_guard lock(post_mu_);
    for (ssize_t i = 0; i < n; ++i) {
      Op* op = static_cast<Op*>(entries[i].op_context);
      if (op && op->kind != Op::kRecv) {
        on_completion(op, err::Cancelled("fabric: transport shut down"));
      }
    }
  }
}

void FabricTransport::stop_polling(const Transfer& /*transfer*/, bool finished) {
  if (finished) {
    // A waiter that found its transfer done (often without polling at all:
    // the progress thread had read the completion) renews the lease too: it
    // comes back with the next transfer and polls then. Without this, a
    // progress thread that once took the CQ over (a wait outlasted
    // engine.wait_spin_us) kept it while the waiter kept finding its
    // transfers done -- two busy initiator threads and the target's on 2
    // cores, and 4 KiB writes at 0.3 instead of 0.45 GB/s.
    waiter_polled_ns_.store(now_ns(), std::memory_order_relaxed);
    return;
  }
  // The waiter goes to sleep: the progress thread takes the CQ back now.
  waiter_polled_ns_.store(0, std::memory_order_relaxed);
  wake(/*urgent=*/true);
}

void FabricTransport::progress_loop() {
  name_this_thread("ferry-fabric");
  auto last_event = Clock::now();
  Clock::duration spin = opt_.poll_spin;  // adapts: see the end of the loop
  uint64_t pumped_gen = 0;
  int64_t waiter_nap_ns = kWaiterLeaseNs;  // see the waiter-polls sleep below
  while (!stop_.load()) {
    const uint64_t gen = work_gen_.load();
    const uint64_t urgent_gen = urgent_gen_.load();
    // A thread in wait() polled the CQ just now: it gets the completions
    // without a hand-over; two threads reading one CQ only take turns.
    const int64_t lease_left =
        waiter_polled_ns_.load(std::memory_order_relaxed) + kWaiterLeaseNs - now_ns();
    const bool waiter_polls = lease_left > 0 && !error_pending_.exchange(false);
    size_t handled = 0;
    // While a waiter polls, cq_mu_ is the waiter's: taking it only to find
    // nothing put aside cost a futex wait and wake-up per nap, each
    // preempting the waiter or the target's thread on 2 cores.
    if (!waiter_polls || deferred_pending_.load()) {
      std::lock_guard cq(cq_mu_);
      deferred_pending_.store(false);
      handled = drain_cq_locked(!waiter_polls);
    }
    if (handled > 0 || (!waiter_polls && (work_gen_.load() != pumped_gen ||
                                          backlog_.load(std::memory_order_relaxed)))) {
      // Room freed, work posted, or the provider said EAGAIN before (progress
      // may have made room, e.g. a connection came up): post what waits. A
      // waiter that polls the CQ pumps on its own: post_mu_ is left to it.
      pumped_gen = work_gen_.load();
      std::lock_guard lock(post_mu_);
      pump_locked();
    }
    timers();  // also while events keep coming: a dead peer is declared in time
    const auto now = Clock::now();
    if (handled > 0) {
      last_event = now;
      continue;
    }
    if (waiter_polls) {
      // Out of the waiter's way until its lease runs out (it stopped
      // polling) or a wake() comes. The nap is the lease left at first and
      // doubles (up to kMaxWaiterNapNs) each time the waiter renewed it
      // meanwhile.
      sleeping_.store(Sleep::kWaiterPolls);
      bool woken = false;
      if (urgent_gen_.load() == urgent_gen) {
        const int64_t nap = std::max(lease_left, waiter_nap_ns);
        struct pollfd fd = {wake_fd_, POLLIN, 0};
        const struct timespec ts = {nap / 1000000000, nap % 1000000000};
        woken = ::ppoll(&fd, 1, &ts, nullptr) > 0;
        if (fd.revents & POLLIN) {
          uint64_t v;
          [[maybe_unused]] auto r = ::read(wake_fd_, &v, sizeof v);
        }
      } else {
        woken = true;
      }
      sleeping_.store(Sleep::kAwake);
      const bool renewed =
          waiter_polled_ns_.load(std::memory_order_relaxed) + kWaiterLeaseNs > now_ns();
      waiter_nap_ns =
          !woken && renewed ? std::min(waiter_nap_ns * 2, kMaxWaiterNapNs) : kWaiterLeaseNs;
      last_event = Clock::time_point{};  // no spin after: read the CQ, then sleep on it
      continue;
    }
    // With manual progress (tcp;ofi_rxm) bytes move only while somebody reads
    // the CQ, on the target too: right after an event more usually follow,
    // so poll a little longer before paying for a sleep and a wake-up.
    if (now - last_event < spin) {
      for (int i = 0; i < 32; ++i) cpu_relax();
      continue;
    }
    // Nothing completed: sleep on the CQ's wait fd (and our wake-up fd) when
    // the provider agrees nothing is pending, else poll again.
    sleeping_.store(Sleep::kOnCq);
    if (work_gen_.load() != gen) {  // a wake() came after this round began
      sleeping_.store(Sleep::kAwake);
      continue;
    }
    const auto until_ping =
        std::chrono::duration_cast<std::chrono::milliseconds>(next_ping_ - Clock::now());
    const int timeout = static_cast<int>(std::clamp<int64_t>(until_ping.count(), 1, 100));
    struct pollfd fds[2];
    int nfds = 0;
    fds[nfds++] = {wake_fd_, POLLIN, 0};
    if (cq_fd_ >= 0) {
      struct fid* f = &cq_->fid;
      if (fi_trywait(fabric_, &f, 1) != 0) {
        // Events pending: read again, and poll a full spin more. A target's
        // provider moves incoming RMA without a completion to show for it, so
        // this (and a quick CQ wake-up, below) is all that shows a stream is
        // on: going to sleep in the middle of one costs a wake-up (on a VM an
        // interrupt to a halted vCPU) while the writer's bytes wait.
        sleeping_.store(Sleep::kAwake);
        last_event = Clock::now();
        continue;
      }
      fds[nfds++] = {cq_fd_, POLLIN, 0};
    }
    const auto slept = Clock::now();
    ::poll(fds, nfds, cq_fd_ >= 0 ? timeout : 1);
    sleeping_.store(Sleep::kAwake);
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] auto r = ::read(wake_fd_, &v, sizeof v);
    }
    last_event = Clock::now();
    // A target's provider moves incoming RMA without a completion to show for
    // it, so activity shows only as wake-ups: woken by the CQ after a sleep
    // shorter than the spin before it means a stream is on, with gaps the
    // spin would have covered -- poll longer next time (up to kMaxPollSpin),
    // as a raw busy loop would; a longer sleep resets it. (The bar was
    // fabric.poll_spin_us: one gap of 50 us-1 ms in a stream -- the writer
    // preempted, its wait gone to sleep -- dropped the spin back to 50 us,
    // and the target then slept between most writes: 2,800 sleeps a second,
    // each woken by the writer's softirq, in the slow 4 KiB rounds.)
    const bool cq_woke = nfds > 1 && (fds[1].revents & POLLIN);
    spin = cq_woke && last_event - slept < spin ? std::min<Clock::duration>(spin * 2, kMaxPollSpin)
                                                : Clock::duration(opt_.poll_spin);
  }
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
    for (auto& j : mine) fail_job_locked(j, why);
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
    fi_addr_t addr = FI_ADDR_UNSPEC;
    if (fi_av_insert(av_, hello->address.data(), 1, &addr, 0, nullptr) != 1) {
      return err::ProtocolError("fabric: HELLO carries an address the provider rejects");
    }
    char text[256] = {};
    size_t tlen = sizeof text;
    fi_av_straddr(av_, hello->address.data(), text, &tlen);
    auto p = std::make_shared<Peer>();
    p->id = h.sender;
    p->addr = addr;
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
    (void)send(p, addr, MsgType::kHelloAck, h.request, encode_status(verdict));
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
