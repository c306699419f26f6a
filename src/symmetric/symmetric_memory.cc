// SymmetricMemory (include/ferry/symmetric.h): one cudaMalloc'd buffer per
// member (data, then signal slots), shared through cuda_ipc's export/import,
// and the device table of peer pointers built from the members' cards.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/byte_codec.h"
#include "core/host_identity.h"
#include "cuda/cuda_util.h"
#include "ferry/symmetric.h"
#include "fmt/format.h"
#include "symmetric/symmetric_kernels.h"
#include "transport/cuda_ipc/cuda_ipc_wire.h"
#include "transport/cuda_ipc/ipc_memory.h"

namespace ferry {
namespace {

using cuda::cuda_status;

constexpr uint32_t kCardMagic = 0x4d595346;  // "FSYM"
constexpr uint16_t kCardVersion = 1;
constexpr uint64_t kSignalAlignment = 256;
constexpr int kMaxMembers = 1024;  // the barrier kernel's one block

uint64_t align_up(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

// What one member tells the others.
struct Card {
  int32_t rank = 0;
  int32_t size = 0;
  std::string boot_id;
  uint32_t pid = 0;
  cuda_ipc::Uuid gpu{};
  uint64_t data_bytes = 0;
  uint32_t signal_slots = 0;
  uint32_t reserved_slots = 0;
  uint64_t signals_offset = 0;
  Bytes grant;  // encode_grant's frame
};

Bytes encode_card(const Card& c) {
  Bytes out;
  ByteWriter w(out);
  w.u32(kCardMagic);
  w.u16(kCardVersion);
  w.u16(0);
  w.u32(static_cast<uint32_t>(c.rank));
  w.u32(static_cast<uint32_t>(c.size));
  w.str16(c.boot_id);
  w.u32(c.pid);
  w.bytes(c.gpu.data(), c.gpu.size());
  w.u64(c.data_bytes);
  w.u32(c.signal_slots);
  w.u32(c.reserved_slots);
  w.u64(c.signals_offset);
  w.u32(static_cast<uint32_t>(c.grant.size()));
  w.bytes(c.grant.data(), c.grant.size());
  return out;
}

Result<Card> decode_card(int index, const std::vector<uint8_t>& bytes) {
  ByteReader r(bytes);
  Card c;
  const uint32_t magic = r.u32();
  const uint16_t version = r.u16();
  r.u16();
  if (!r.ok() || magic != kCardMagic) {
    return err::InvalidArgument(fmt::format(
        "symmetric: cards[{}] is not a symmetric-memory card ({} bytes)", index, bytes.size()));
  }
  if (version != kCardVersion) {
    return err::InvalidArgument(
        fmt::format("symmetric: cards[{}] has card version {}, this build reads version {}", index,
                    version, kCardVersion));
  }
  c.rank = static_cast<int32_t>(r.u32());
  c.size = static_cast<int32_t>(r.u32());
  c.boot_id = r.str16();
  c.pid = r.u32();
  auto uuid = r.bytes(c.gpu.size());
  if (r.ok()) std::memcpy(c.gpu.data(), uuid.data(), c.gpu.size());
  c.data_bytes = r.u64();
  c.signal_slots = r.u32();
  c.reserved_slots = r.u32();
  c.signals_offset = r.u64();
  const uint32_t grant_bytes = r.u32();
  auto grant = r.bytes(grant_bytes);
  if (!r.ok() || r.remaining() != 0) {
    return err::InvalidArgument(fmt::format(
        "symmetric: cards[{}] is truncated or has trailing bytes ({} bytes)", index, bytes.size()));
  }
  c.grant.assign(grant.begin(), grant.end());
  return c;
}

Result<cuda_ipc::Grant> decode_grant_frame(int member, const Bytes& frame) {
  ByteView all(frame.data(), frame.size());
  auto header = cuda_ipc::decode_header(all);
  if (!header.ok()) return header.status();
  if (header->op != cuda_ipc::Op::kGrant ||
      frame.size() != cuda_ipc::kFrameHeaderBytes + header->body_bytes) {
    return err::InvalidArgument(
        fmt::format("symmetric: member {}'s card carries no IPC grant", member));
  }
  return cuda_ipc::decode_grant(all.subspan(cuda_ipc::kFrameHeaderBytes));
}

}  // namespace

struct SymmetricMemory::Impl {
  SymmetricOptions options;
  uint32_t reserved_slots = 0;
  uint64_t signals_offset = 0;
  uint64_t alloc_bytes = 0;
  uint8_t* buffer = nullptr;     // this member's allocation
  DeviceError* error = nullptr;  // host-mapped (cudaHostAllocMapped)
  DeviceError* error_device = nullptr;
  Bytes grant;
  std::vector<std::shared_ptr<cuda_ipc::Mapping>> mappings;  // by member; null for self
  std::vector<uint64_t> peer_data;                           // by member
  std::vector<uint64_t> peer_signals;
  uint64_t* device_arrays = nullptr;  // [size] data pointers, then [size] signal pointers
  DeviceTeam* device_team = nullptr;
  DeviceTeam team{};
  cudaStream_t reader = nullptr;
  uint64_t sm_count =
      1;  // blocks of a host-posted put, at most  // non-blocking: read_signal while kernels wait
  bool joined = false;
  uint64_t barrier_epoch = 0;

  ~Impl() {
    cuda::DeviceGuard guard(options.device);
    mappings.clear();  // unmapped before our own buffer goes
    if (device_arrays != nullptr) cudaFree(device_arrays);
    if (device_team != nullptr) cudaFree(device_team);
    if (buffer != nullptr) cudaFree(buffer);
    if (error != nullptr) cudaFreeHost(error);
    if (reader != nullptr) cudaStreamDestroy(reader);
    cudaGetLastError();
  }
};

SymmetricMemory::SymmetricMemory(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SymmetricMemory::~SymmetricMemory() = default;

Result<std::unique_ptr<SymmetricMemory>> SymmetricMemory::create(const SymmetricOptions& o) {
  if (o.size < 1 || o.size > kMaxMembers) {
    return err::InvalidArgument(
        fmt::format("symmetric: size {} is outside [1, {}]", o.size, kMaxMembers));
  }
  if (o.rank < 0 || o.rank >= o.size) {
    return err::InvalidArgument(
        fmt::format("symmetric: rank {} is outside [0, {})", o.rank, o.size));
  }
  if (o.wait_timeout_ns == 0) {
    return err::InvalidArgument("symmetric: wait_timeout_ns must be > 0");
  }
  auto gpus = cuda_ipc::visible_gpus();
  if (!gpus.ok()) return gpus.status();
  auto impl = std::make_unique<Impl>();
  impl->options = o;
  if (impl->options.device < 0) impl->options.device = cuda_ipc::current_device();
  const int dev = impl->options.device;
  if (dev >= static_cast<int>(gpus->size())) {
    return err::InvalidArgument(fmt::format(
        "symmetric: device {} does not exist here ({} GPUs visible)", dev, gpus->size()));
  }
  impl->reserved_slots = static_cast<uint32_t>(o.size);
  impl->signals_offset = align_up(o.data_bytes, kSignalAlignment);
  impl->alloc_bytes =
      impl->signals_offset + 8ull * (uint64_t{o.signal_slots} + impl->reserved_slots);
  cuda::DeviceGuard guard(dev);
  if (guard.status() != cudaSuccess) return cuda_status(guard.status(), "cudaSetDevice");
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, impl->alloc_bytes); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e,
                       fmt::format("symmetric: cudaMalloc({} bytes)", impl->alloc_bytes).c_str());
  }
  impl->buffer = static_cast<uint8_t*>(p);
  if (cudaError_t e = cudaMemset(p, 0, impl->alloc_bytes); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "symmetric: cudaMemset");
  }
  void* host = nullptr;
  if (cudaError_t e =
          cudaHostAlloc(&host, sizeof(DeviceError), cudaHostAllocMapped | cudaHostAllocPortable);
      e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "symmetric: cudaHostAlloc(error record)");
  }
  impl->error = static_cast<DeviceError*>(host);
  std::memset(impl->error, 0, sizeof(DeviceError));
  void* mapped = nullptr;
  if (cudaError_t e = cudaHostGetDevicePointer(&mapped, host, 0); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "symmetric: cudaHostGetDevicePointer(error record)");
  }
  impl->error_device = static_cast<DeviceError*>(mapped);
  if (cudaError_t e = cudaStreamCreateWithFlags(&impl->reader, cudaStreamNonBlocking);
      e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "symmetric: cudaStreamCreateWithFlags");
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) {
    cudaGetLastError();
    sms = 1;
  }
  impl->sm_count = static_cast<uint64_t>(sms);
  if (cudaError_t e = symmetric::preload_kernels(); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "symmetric: loading the kernels");
  }
  auto exported = cuda_ipc::export_memory(impl->buffer, impl->alloc_bytes);
  if (!exported.ok()) return exported.status();
  if (exported->grant.kind != cuda_ipc::HandleKind::kLegacy || !exported->fds.empty()) {
    return err::Internal("symmetric: cudaMalloc memory was not exported by a legacy IPC handle");
  }
  impl->grant = cuda_ipc::encode_grant(exported->grant);
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "symmetric: cudaDeviceSynchronize");
  }
  return std::unique_ptr<SymmetricMemory>(new SymmetricMemory(std::move(impl)));
}

std::vector<uint8_t> SymmetricMemory::card() const {
  Card c;
  c.rank = impl_->options.rank;
  c.size = impl_->options.size;
  c.boot_id = kernel_boot_id();
  c.pid = static_cast<uint32_t>(::getpid());
  auto gpus = cuda_ipc::visible_gpus();
  if (gpus.ok()) c.gpu = (*gpus)[static_cast<size_t>(impl_->options.device)];
  c.data_bytes = impl_->options.data_bytes;
  c.signal_slots = impl_->options.signal_slots;
  c.reserved_slots = impl_->reserved_slots;
  c.signals_offset = impl_->signals_offset;
  c.grant = impl_->grant;
  return encode_card(c);
}

Status SymmetricMemory::join(const std::vector<std::vector<uint8_t>>& cards) {
  Impl& m = *impl_;
  const SymmetricOptions& o = m.options;
  if (m.joined) return err::InvalidArgument("symmetric: join() was already called");
  if (cards.size() != static_cast<size_t>(o.size)) {
    return err::InvalidArgument(fmt::format(
        "symmetric: join() got {} cards for a group of {} members", cards.size(), o.size));
  }
  const std::string my_boot = kernel_boot_id();
  std::vector<Card> decoded;
  for (int r = 0; r < o.size; ++r) {
    auto c = decode_card(r, cards[static_cast<size_t>(r)]);
    if (!c.ok()) return c.status();
    if (c->rank != r || c->size != o.size) {
      return err::InvalidArgument(fmt::format(
          "symmetric: cards[{}] is member {} of a group of {}, expected member {} of {}", r,
          c->rank, c->size, r, o.size));
    }
    if (my_boot.empty() || c->boot_id != my_boot) {
      return err::InvalidArgument(fmt::format(
          "symmetric: member {} is not on this host (its kernel boot id '{}', ours '{}'); "
          "symmetric memory joins processes of one host only",
          r, c->boot_id, my_boot));
    }
    if (c->data_bytes != o.data_bytes || c->signal_slots != o.signal_slots) {
      return err::InvalidArgument(fmt::format(
          "symmetric: sizes differ: member {} has {} data bytes and {} signal slots, member {} "
          "(this one) has {} and {}",
          r, c->data_bytes, c->signal_slots, o.rank, o.data_bytes, o.signal_slots));
    }
    decoded.push_back(std::move(*c));
  }
  if (decoded[static_cast<size_t>(o.rank)].pid != static_cast<uint32_t>(::getpid())) {
    return err::InvalidArgument(fmt::format(
        "symmetric: cards[{}] (this member's place) comes from process {}, not this one", o.rank,
        decoded[static_cast<size_t>(o.rank)].pid));
  }
  // Check every pair before mapping anything.
  std::vector<int> ordinals(static_cast<size_t>(o.size), o.device);
  for (int r = 0; r < o.size; ++r) {
    if (r == o.rank) continue;
    const Card& c = decoded[static_cast<size_t>(r)];
    const int dev = cuda_ipc::ordinal_of(c.gpu);
    if (dev < 0) {
      return err::NotSupported(
          fmt::format("symmetric: member {}'s GPU {} is not visible in this process "
                      "(CUDA_VISIBLE_DEVICES?); its memory cannot be mapped here",
                      r, cuda_ipc::uuid_text(c.gpu)));
    }
    if (dev != o.device) {
      int can = 0;
      if (cudaError_t e = cudaDeviceCanAccessPeer(&can, o.device, dev); e != cudaSuccess) {
        cudaGetLastError();
        return cuda_status(e, "symmetric: cudaDeviceCanAccessPeer");
      }
      if (can == 0) {
        return err::NotSupported(fmt::format(
            "symmetric: GPU {} (member {}) has no peer access to GPU {} (member {}, {}); "
            "their kernels cannot store into each other's memory",
            o.device, o.rank, dev, r, cuda_ipc::uuid_text(c.gpu)));
      }
    }
    ordinals[static_cast<size_t>(r)] = dev;
  }
  cuda::DeviceGuard guard(o.device);
  m.mappings.assign(static_cast<size_t>(o.size), nullptr);
  m.peer_data.assign(static_cast<size_t>(o.size), 0);
  m.peer_signals.assign(static_cast<size_t>(o.size), 0);
  const auto pid = static_cast<uint32_t>(::getpid());
  for (int r = 0; r < o.size; ++r) {
    const Card& c = decoded[static_cast<size_t>(r)];
    uint8_t* base = m.buffer;
    if (r != o.rank) {
      if (Status s = cuda_ipc::ensure_peer_access(o.device, ordinals[static_cast<size_t>(r)]);
          !s.ok()) {
        return s;
      }
      auto grant = decode_grant_frame(r, c.grant);
      if (!grant.ok()) return grant.status();
      auto mapping = cuda_ipc::Mapping::import(*grant, {}, c.pid == pid, o.device);
      if (!mapping.ok()) {
        return Status(mapping.status().code(),
                      fmt::format("symmetric: mapping member {}'s buffer: {}", r,
                                  mapping.status().message()));
      }
      base = (*mapping)->base() + (grant->region_address - grant->span_base);
      m.mappings[static_cast<size_t>(r)] = std::move(*mapping);
    }
    m.peer_data[static_cast<size_t>(r)] = reinterpret_cast<uint64_t>(base);
    m.peer_signals[static_cast<size_t>(r)] = reinterpret_cast<uint64_t>(base + c.signals_offset);
  }
  const size_t table_bytes = 2 * sizeof(uint64_t) * static_cast<size_t>(o.size);
  void* arrays = nullptr;
  void* team = nullptr;
  if (cudaError_t e = cudaMalloc(&arrays, table_bytes); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "symmetric: cudaMalloc(device table)");
  }
  m.device_arrays = static_cast<uint64_t*>(arrays);
  if (cudaError_t e = cudaMalloc(&team, sizeof(DeviceTeam)); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "symmetric: cudaMalloc(device team)");
  }
  m.device_team = static_cast<DeviceTeam*>(team);
  std::vector<uint64_t> host_arrays(m.peer_data);
  host_arrays.insert(host_arrays.end(), m.peer_signals.begin(), m.peer_signals.end());
  m.team.rank = o.rank;
  m.team.size = o.size;
  m.team.data_bytes = o.data_bytes;
  m.team.signal_slots = o.signal_slots;
  m.team.reserved_slots = m.reserved_slots;
  m.team.timeout_ns = o.wait_timeout_ns;
  m.team.data = reinterpret_cast<uint8_t* const*>(m.device_arrays);
  m.team.signals = reinterpret_cast<uint64_t* const*>(m.device_arrays + o.size);
  m.team.error = m.error_device;
  if (cudaError_t e = cudaMemcpy(arrays, host_arrays.data(), table_bytes, cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "symmetric: cudaMemcpy(device table)");
  }
  if (cudaError_t e = cudaMemcpy(team, &m.team, sizeof(DeviceTeam), cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "symmetric: cudaMemcpy(device team)");
  }
  m.joined = true;
  return Status::Ok();
}

bool SymmetricMemory::joined() const {
  return impl_->joined;
}
int SymmetricMemory::rank() const {
  return impl_->options.rank;
}
int SymmetricMemory::size() const {
  return impl_->options.size;
}
int SymmetricMemory::device() const {
  return impl_->options.device;
}
uint64_t SymmetricMemory::data_bytes() const {
  return impl_->options.data_bytes;
}
uint32_t SymmetricMemory::signal_slots() const {
  return impl_->options.signal_slots;
}
void* SymmetricMemory::local_data() const {
  return impl_->buffer;
}
uint64_t* SymmetricMemory::local_signals() const {
  return reinterpret_cast<uint64_t*>(impl_->buffer + impl_->signals_offset);
}
void* SymmetricMemory::peer_data(int r) const {
  if (!impl_->joined || r < 0 || r >= size()) return nullptr;
  return reinterpret_cast<void*>(impl_->peer_data[static_cast<size_t>(r)]);
}
uint64_t* SymmetricMemory::peer_signals(int r) const {
  if (!impl_->joined || r < 0 || r >= size()) return nullptr;
  return reinterpret_cast<uint64_t*>(impl_->peer_signals[static_cast<size_t>(r)]);
}
DeviceTeam SymmetricMemory::team() const {
  return impl_->team;
}
const DeviceTeam* SymmetricMemory::device_team_ptr() const {
  return impl_->device_team;
}
const uint64_t* SymmetricMemory::device_peer_data() const {
  return impl_->device_arrays;
}
const uint64_t* SymmetricMemory::device_peer_signals() const {
  return impl_->device_arrays == nullptr ? nullptr : impl_->device_arrays + size();
}

Status SymmetricMemory::device_error() const {
  const DeviceError& e = *impl_->error;
  const uint32_t code = __atomic_load_n(&e.code, __ATOMIC_ACQUIRE);
  switch (code) {
    case kDeviceErrorNone:
    case 0xffffffffu:  // being written
      return Status::Ok();
    case kDeviceErrorWaitTimeout:
      return err::Timeout(fmt::format(
          "symmetric: member {} waited {} ns on its signal slot {} for >= {}, it stayed at {} "
          "(block {}, thread {})",
          e.rank, e.waited_ns, e.slot, e.expected, e.observed, e.block, e.thread));
    case kDeviceErrorBadPeer:
      return err::InvalidArgument(fmt::format(
          "symmetric: a device call on member {} named member {} of a group of {} (block {}, "
          "thread {})",
          e.rank, e.peer, e.expected, e.block, e.thread));
    case kDeviceErrorBadSlot:
      return err::InvalidArgument(fmt::format(
          "symmetric: a device call on member {} named signal slot {} of member {}, which has {} "
          "(block {}, thread {})",
          e.rank, e.slot, e.peer, e.expected, e.block, e.thread));
    case kDeviceErrorOutOfRange:
      return err::OutOfRange(fmt::format(
          "symmetric: a put on member {} to member {} ends at byte {}, past the data area of {} "
          "(block {}, thread {})",
          e.rank, e.peer, e.expected, e.observed, e.block, e.thread));
    case kDeviceErrorLineTimeout:
      return err::Timeout(fmt::format(
          "symmetric: member {} waited {} ns for member {}'s low-latency data of round {}; its "
          "flag stayed at {} (block {}, thread {})",
          e.rank, e.waited_ns, e.peer, e.expected, e.observed, e.block, e.thread));
    case kDeviceErrorFlagTimeout:
      return err::Timeout(fmt::format(
          "symmetric: member {} waited {} ns for member {}'s staged data of round {}; its flag "
          "stayed at {} (block {}, thread {})",
          e.rank, e.waited_ns, e.peer, e.expected, e.observed, e.block, e.thread));
    default:
      return err::Internal(fmt::format("symmetric: unknown device error code {}", code));
  }
}

void SymmetricMemory::clear_device_error() {
  std::memset(impl_->error, 0, sizeof(DeviceError));
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

namespace {
Status not_joined() {
  return err::InvalidArgument("symmetric: join() the group first");
}
}  // namespace

Status SymmetricMemory::put(int peer, uint64_t dst_offset, const void* src, uint64_t bytes,
                            void* stream) {
  if (!impl_->joined) return not_joined();
  if (peer < 0 || peer >= size()) {
    return err::InvalidArgument(
        fmt::format("symmetric: put to member {} of a group of {}", peer, size()));
  }
  if (dst_offset > data_bytes() || bytes > data_bytes() - dst_offset) {
    return err::OutOfRange(fmt::format(
        "symmetric: put of {} bytes at offset {} to member {} ends past its {} data bytes", bytes,
        dst_offset, peer, data_bytes()));
  }
  if (bytes == 0) return Status::Ok();
  cuda::DeviceGuard guard(device());
  // Stores from a kernel, each thread ending with quiet(): ordered before a
  // later signal by the device API's own rules, as a device put is (a
  // copy-engine copy's writes are outside the PTX memory model that the
  // signal's release is defined by).
  const uint64_t chunks = (bytes + (64 << 10) - 1) >> 16;
  const int blocks = static_cast<int>(std::min<uint64_t>(chunks, impl_->sm_count));
  return cuda_status(symmetric::launch_put(impl_->team, peer, dst_offset, src, bytes, blocks,
                                           static_cast<cudaStream_t>(stream)),
                     "symmetric: put kernel launch");
}

Status SymmetricMemory::signal(int peer, uint32_t slot, uint64_t value, bool add, void* stream) {
  if (!impl_->joined) return not_joined();
  if (peer < 0 || peer >= size()) {
    return err::InvalidArgument(
        fmt::format("symmetric: signal to member {} of a group of {}", peer, size()));
  }
  if (slot >= signal_slots()) {
    return err::InvalidArgument(
        fmt::format("symmetric: signal slot {} of member {}: the group has {} slots", slot, peer,
                    signal_slots()));
  }
  cuda::DeviceGuard guard(device());
  return cuda_status(symmetric::launch_signal(impl_->team, peer, slot, value, add,
                                              static_cast<cudaStream_t>(stream)),
                     "symmetric: signal kernel launch");
}

Status SymmetricMemory::wait(uint32_t slot, uint64_t at_least, void* stream, uint64_t timeout_ns) {
  if (!impl_->joined) return not_joined();
  if (slot >= signal_slots()) {
    return err::InvalidArgument(fmt::format(
        "symmetric: wait on signal slot {}: the group has {} slots", slot, signal_slots()));
  }
  cuda::DeviceGuard guard(device());
  return cuda_status(symmetric::launch_wait(impl_->team, slot, at_least, timeout_ns,
                                            static_cast<cudaStream_t>(stream)),
                     "symmetric: wait kernel launch");
}

Status SymmetricMemory::barrier(void* stream) {
  if (!impl_->joined) return not_joined();
  cuda::DeviceGuard guard(device());
  ++impl_->barrier_epoch;
  return cuda_status(symmetric::launch_barrier(impl_->team, impl_->barrier_epoch,
                                               static_cast<cudaStream_t>(stream)),
                     "symmetric: barrier kernel launch");
}

uint64_t SymmetricMemory::read_signal(uint32_t slot) const {
  if (slot >= signal_slots() + impl_->reserved_slots) return 0;
  uint64_t v = 0;
  cuda::DeviceGuard guard(device());
  if (cudaMemcpyAsync(&v, local_signals() + slot, sizeof v, cudaMemcpyDeviceToHost,
                      impl_->reader) != cudaSuccess ||
      cudaStreamSynchronize(impl_->reader) != cudaSuccess) {
    cudaGetLastError();
  }
  return v;
}

}  // namespace ferry
