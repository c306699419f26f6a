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
#include "transport/fabric/fabric_internal.h"

namespace ferry::fabric {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

namespace {

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

}  // namespace

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
    {"fabric.peer_window_percent", OptionType::kUint, "75",
     "the share of fabric.max_inflight and fabric.max_inflight_bytes that one peer's operations "
     "may hold, so that a stopped or slow peer leaves the rest to the others; 100: no limit",
     1, 100},
    {"fabric.connect_timeout_ms", OptionType::kDurationMs, "5000",
     "time allowed for the fabric handshake with a peer", 1, 600000},
    {"fabric.grant_timeout_ms", OptionType::kDurationMs, "10000",
     "time allowed for a peer to answer a key request (first use of a descriptor)", 1, 600000},
    {"fabric.peer_timeout_ms", OptionType::kDurationMs, "1500",
     "a peer not heard from (keepalive) this long is declared dead and its transfers fail", 100,
     600000},
    {"fabric.cancel_timeout_ms", OptionType::kDurationMs, "10000",
     "how long cancel() waits for the operations of a transfer the provider already holds (a "
     "stopped peer's hold them until it resumes); past it cancel() returns, logs an error naming "
     "the transfer, and the provider may still touch its buffers",
     1, 600000},
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
  av_table_ = std::make_shared<AvTable>(av_);
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
  opt_.peer_window_percent = static_cast<uint32_t>(o.get_uint("fabric.peer_window_percent"));
  peer_max_inflight_ = std::max<uint64_t>(1, opt_.max_inflight * opt_.peer_window_percent / 100);
  peer_max_inflight_bytes_ =
      std::max<uint64_t>(1, opt_.max_inflight_bytes / 100 * opt_.peer_window_percent);
  opt_.connect_timeout = std::chrono::milliseconds(o.get_uint("fabric.connect_timeout_ms"));
  opt_.grant_timeout = std::chrono::milliseconds(o.get_uint("fabric.grant_timeout_ms"));
  opt_.peer_timeout = std::chrono::milliseconds(o.get_uint("fabric.peer_timeout_ms"));
  opt_.cancel_timeout = std::chrono::milliseconds(o.get_uint("fabric.cancel_timeout_ms"));
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
  if (av_table_) av_table_->close();  // peers still held somewhere remove nothing now
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

}  // namespace ferry::fabric
