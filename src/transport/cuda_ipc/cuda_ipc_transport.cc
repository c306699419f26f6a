// cuda_ipc transport: the option table, start and shutdown. The rest of the
// class is spread over its rooms: cuda_ipc_connection (handshake, peers),
// cuda_ipc_registry (grants and revocation), cuda_ipc_datapath (posting,
// cancel), cuda_ipc_copy_requests (local GPU with peer host memory) and
// cuda_ipc_progress (the I/O and completion threads).
#include "transport/cuda_ipc/cuda_ipc_transport.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "cuda/cuda_detect.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/common/unix_socket.h"
#include "transport/cuda_ipc/cuda_ipc_internal.h"

namespace ferry::cuda_ipc {

const OptionSpec kCudaIpcOptionSpecs[] = {
    {"cuda_ipc.socket_dir", OptionType::kString, "/tmp",
     "directory of the control socket ferry-ipc-<engine id>-<pid>.sock; peers must see the same "
     "directory"},
    {"cuda_ipc.connect_timeout_ms", OptionType::kDurationMs, "5000",
     "time allowed for connecting and the handshake", 1, 600000},
    {"cuda_ipc.grant_timeout_ms", OptionType::kDurationMs, "10000",
     "time allowed for the peer to answer a grant request (mapping a region for the first time)", 1,
     600000},
    {"cuda_ipc.revoke_timeout_ms", OptionType::kDurationMs, "2000",
     "a peer that has not released a deregistered region this long after being asked loses its "
     "connection (deregistration then completes)",
     1, 600000},
    {"cuda_ipc.send_timeout_ms", OptionType::kDurationMs, "10000",
     "a peer that does not drain its control socket for this long is declared dead", 100, 3600000},
    {"cuda_ipc.sm_budget", OptionType::kUint, "8",
     "most SMs the copy kernel for small blocks may occupy (0: copy engine only)", 0, 1024},
    {"cuda_ipc.poll_linger_us", OptionType::kUint, "50",
     "after the last copy in flight completed, the completion thread keeps polling this long "
     "before it sleeps (a next copy is then noticed without a wake-up)",
     0, 100000},
    {"cuda_ipc.waiter_polls", OptionType::kBool, "true",
     "a thread spinning in wait() polls the copy streams itself (no hand-over from the "
     "completion thread)"},
    {"cuda_ipc.after_default_stream", OptionType::kBool, "true",
     "copies start after work already queued on the GPU's legacy default stream (where PyTorch "
     "produces tensors unless told otherwise), so a tensor filled just before a write or read "
     "is filled first; false: the caller synchronises"},
    {"cuda_ipc.engine_max_blocks", OptionType::kUint, "1",
     "calls of at most this many blocks go to the copy engine (cudaMemcpyAsync) rather than the "
     "copy kernel: for a single small block that is lower latency than a kernel launch",
     0, 1024},
    {"cuda_ipc.kernel_max_block", OptionType::kBytes, "256KiB",
     "blocks smaller than this go through the copy kernel, larger ones to the copy engine", 0,
     1ull << 30},
    {"cuda_ipc.peer_kernel_max_block", OptionType::kBytes, "256KiB",
     "the same for copies between two GPUs (over NVLink or PCIe peer access): there the copy "
     "engine pays more per block",
     0, 1ull << 30},
    {"cuda_ipc.resident_max_block", OptionType::kBytes, "64KiB",
     "a call of one block of device memory of at most this size, between two GPUs, goes to the "
     "resident copy kernel, which stays on the GPU (one SM) for cuda_ipc.resident_linger_us "
     "after its last copy and takes the next without a launch or driver call (0: never)",
     0, 1ull << 30},
    {"cuda_ipc.same_gpu_resident_max_block", OptionType::kBytes, "128KiB",
     "the same for a block copied within one GPU (both processes on it), where a copy-engine "
     "copy costs more than across NVLink and the kernel is ahead up to 128 KiB "
     "(docs/benchmarks.md)",
     0, 1ull << 30},
    {"cuda_ipc.resident_linger_us", OptionType::kUint, "200",
     "how long the resident copy kernel waits for the next small copy before it leaves the GPU", 1,
     100000},
    {"cuda_ipc.batch_api", OptionType::kBool, "true",
     "copy-engine blocks of a call go to one cudaMemcpyBatchAsync (false: one cudaMemcpyAsync "
     "each)"},
    {"cuda_ipc.trace", OptionType::kBool, "false",
     "stage trace of every transfer this engine initiates over cuda_ipc (posted, copies "
     "submitted, copies seen done, completed; docs/trace.md); off costs one branch"},
    {"cuda_ipc.trace_keep", OptionType::kUint, "4096",
     "finished traced transfers kept for reading (the last N)", 1, 1u << 20},
    {"cuda_ipc.fault_refuse_import", OptionType::kBool, "false",
     "testing: act as if the driver refused to map every peer allocation (no peer access, IPC "
     "not permitted), so that the fallback to staging through shm can be exercised on machines "
     "whose driver allows it"},
};
const size_t kCudaIpcOptionSpecCount = std::size(kCudaIpcOptionSpecs);

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

Connection::~Connection() {
  if (fd >= 0) ::close(fd);
  for (int d : rx_fds) ::close(d);
  for (auto& [id, w] : grant_waits) {
    for (int d : w.fds) ::close(d);
  }
}

CudaIpcTransport::~CudaIpcTransport() {
  shutdown(err::Cancelled("cuda_ipc transport destroyed"));
}

TransportCaps CudaIpcTransport::capabilities() const {
  TransportCaps caps;
  caps.host_memory = false;
  caps.cuda_memory = true;
  caps.cuda_peer_only = true;
  caps.gpu_to_peer_host = true;  // target-driven: PUSH_EXPORT + COPY_REQ
  caps.same_host_only = true;
  // A peer whose memory the driver refused to map is left to the next
  // transport (capabilities_for).
  caps.varies_by_peer = true;
  return caps;
}

TransportCaps CudaIpcTransport::capabilities_for(PeerId peer) const {
  TransportCaps caps = capabilities();
  if (refused_peers_.load(std::memory_order_relaxed) != 0 && !driver_refusal(peer).empty()) {
    caps.cuda_memory = false;  // and host_memory is false: it carries nothing to this peer
  }
  return caps;
}

std::string CudaIpcTransport::peer_limits(PeerId peer) const {
  if (refused_peers_.load(std::memory_order_relaxed) == 0) return {};
  const std::string why = driver_refusal(peer);
  if (why.empty()) return {};
  return "carries nothing to this peer: the driver refused to map its GPU memory (" + why + ")";
}

std::string CudaIpcTransport::driver_refusal(PeerId peer) const {
  std::lock_guard lock(mu_);
  for (const auto& c : open_) {
    if (c->peer != peer) continue;
    std::lock_guard clock(c->mu);
    if (!c->driver_refused.empty()) return c->driver_refused;
  }
  return {};
}

Status CudaIpcTransport::read_options() {
  const OptionSet& o = *ctx_.options;
  opt_.socket_dir = o.get_string("cuda_ipc.socket_dir");
  opt_.connect_timeout = std::chrono::milliseconds(o.get_uint("cuda_ipc.connect_timeout_ms"));
  opt_.grant_timeout = std::chrono::milliseconds(o.get_uint("cuda_ipc.grant_timeout_ms"));
  opt_.revoke_timeout = std::chrono::milliseconds(o.get_uint("cuda_ipc.revoke_timeout_ms"));
  opt_.send_timeout = std::chrono::milliseconds(o.get_uint("cuda_ipc.send_timeout_ms"));
  opt_.sm_budget = static_cast<uint32_t>(o.get_uint("cuda_ipc.sm_budget"));
  opt_.kernel_max_block = o.get_uint("cuda_ipc.kernel_max_block");
  opt_.peer_kernel_max_block = o.get_uint("cuda_ipc.peer_kernel_max_block");
  opt_.batch_api = o.get_bool("cuda_ipc.batch_api");
  opt_.resident_max_block = o.get_uint("cuda_ipc.resident_max_block");
  opt_.same_gpu_resident_max_block = o.get_uint("cuda_ipc.same_gpu_resident_max_block");
  opt_.resident_linger_us = static_cast<uint32_t>(o.get_uint("cuda_ipc.resident_linger_us"));
  opt_.waiter_polls = o.get_bool("cuda_ipc.waiter_polls");
  opt_.after_default_stream = o.get_bool("cuda_ipc.after_default_stream");
  opt_.engine_max_blocks = static_cast<uint32_t>(o.get_uint("cuda_ipc.engine_max_blocks"));
  opt_.poll_linger = std::chrono::microseconds(o.get_uint("cuda_ipc.poll_linger_us"));
  if (o.get_bool("cuda_ipc.trace")) {
    trace_log_ = trace_log_for(ctx_.engine_id, o.get_uint("cuda_ipc.trace_keep"));
  }
  opt_.fault_refuse_import = o.get_bool("cuda_ipc.fault_refuse_import");
  return Status::Ok();
}

Status CudaIpcTransport::start(const TransportContext& context) {
  ctx_ = context;
  if (Status s = read_options(); !s.ok()) return s;
  auto gpus = visible_gpus();
  if (!gpus.ok()) return err::NotSupported("cuda_ipc: " + gpus.status().message());
  address_.gpus = *gpus;
  for (size_t i = 0; i < gpus->size(); ++i) {
    address_.gpu_pci.push_back(cuda_device_pci(static_cast<int>(i)));
  }
  address_.pid = static_cast<uint32_t>(::getpid());
  socket_path_ =
      fmt::format("{}/ferry-ipc-{}-{}.sock", opt_.socket_dir == "/" ? "" : opt_.socket_dir,
                  hex_id(ctx_.engine_id), ::getpid());
  address_.socket_path = socket_path_;
  auto fd = unix_socket::listen_at(socket_path_, "cuda_ipc");
  if (!fd.ok()) return fd.status();
  listen_fd_ = *fd;
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wakefd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || wakefd_ < 0) {
    return err::Internal("cuda_ipc: epoll/eventfd: " + unix_socket::errno_text(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeTag;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, wakefd_, &ev);
  ev.data.u64 = kListenTag;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  {
    std::lock_guard lock(mu_);
    started_ = true;
  }
  io_thread_ = std::thread([this] { io_loop(); });
  completion_thread_ = std::thread([this] { completion_loop(); });
  spdlog::debug("cuda_ipc: listening on {} ({} GPUs)", socket_path_, address_.gpus.size());
  return Status::Ok();
}

void CudaIpcTransport::shutdown(const Status& reason) {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    if (!started_) return;
  }
  io_stop_.store(true);
  uint64_t one = 1;
  [[maybe_unused]] auto w = ::write(wakefd_, &one, sizeof one);
  if (io_thread_.joinable()) io_thread_.join();
  std::vector<std::shared_ptr<Connection>> all;
  {
    std::lock_guard lock(io_mu_);
    for (auto& [raw, c] : watched_) all.push_back(c);
    watched_.clear();
  }
  for (auto& c : all) fail_connection(*c, reason);
  // Copies already on the GPU finish (they cannot be called back); the
  // completion thread completes their transfers, failed, as the connections
  // are dead.
  {
    std::lock_guard lock(completion_mu_);
    completion_stop_ = true;
  }
  completion_cv_.notify_all();
  if (completion_thread_.joinable()) completion_thread_.join();
  {
    std::lock_guard lock(slots_mu_);
    for (auto& s : slots_) {
      for (InFlight& f : s->fifo) {
        if (f.transfer) f.transfer->complete(reason);
      }
      s->fifo.clear();
    }
    slots_.clear();  // CopyStream's destructor waits for its stream
  }
  {
    std::lock_guard lock(mu_);
    primary_.clear();
    open_.clear();
  }
  revokes_.clear();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(socket_path_.c_str());
  }
  if (epfd_ >= 0) ::close(epfd_);
  if (wakefd_ >= 0) ::close(wakefd_);
  listen_fd_ = epfd_ = wakefd_ = -1;
}

Bytes CudaIpcTransport::local_address() const {
  return encode_address(address_);
}

std::string CudaIpcTransport::local_address_text() const {
  return fmt::format("unix:{} ({} GPU{})", socket_path_, address_.gpus.size(),
                     address_.gpus.size() == 1 ? "" : "s");
}

std::string CudaIpcTransport::describe(const Connection& c) const {
  return fmt::format("cuda_ipc connection to engine {} (pid {}, {})", hex_id(c.peer), c.pid, c.via);
}

}  // namespace ferry::cuda_ipc
