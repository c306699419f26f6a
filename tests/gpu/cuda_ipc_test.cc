// The cuda_ipc transport between two real processes on one host (one GPU
// serves both where the machine has one): GPU memory of the target process
// written and read by the initiator from GPU, pinned and pageable host memory;
// cudaMalloc, sub-allocations inside one allocation, VMM (cuMem, two physical
// pieces), a buffer freed and allocated again, deregistration while copies
// run, notifications after the data, a peer killed mid-copy, and refusals.
// Also local GPU memory with the target's pageable and pinned host memory,
// which the target copies (PUSH_EXPORT + COPY_REQ).
// Random data; every byte checked by the target process itself (FNV-1a of its
// memory). Skips, with the reason, where no CUDA device answers.
// Run a third way (ctest gpu.one_gpu_each.*, FERRY_TEST_ONE_GPU_EACH=0,1): this
// process with CUDA_VISIBLE_DEVICES=0, the target with CUDA_VISIBLE_DEVICES=1,
// as serving stacks launch their workers -- neither process sees the other's
// GPU, and every test above must pass all the same.
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "ferry/engine.h"
#include "ferry/gpu.h"
#include "gpu_test_util.h"
#include "target_process.h"
#include "tcp_gpu_common.h"

namespace ferry {
namespace {

constexpr size_t kLocalSize = 64u << 20;

// ctest's gpu.one_gpu_each.* sets FERRY_TEST_ONE_GPU_EACH=A,B (one variable:
// gtest_discover_tests passes only the first of several): this process sees
// GPU A only, the target GPU B only. Applied before main(), so before CUDA
// reads CUDA_VISIBLE_DEVICES.
[[maybe_unused]] const bool kOneGpuEachApplied = [] {
  const char* v = std::getenv("FERRY_TEST_ONE_GPU_EACH");
  const std::string s = v != nullptr ? v : "";
  const size_t comma = s.find(',');
  if (comma == std::string::npos) return false;
  setenv("CUDA_VISIBLE_DEVICES", s.substr(0, comma).c_str(), 1);
  setenv("FERRY_TEST_PEER_VISIBLE_DEVICES", s.substr(comma + 1).c_str(), 1);
  return true;
}();

// The target's CUDA_VISIBLE_DEVICES when it is to see another GPU than this
// process ("" when both see the same GPUs).
std::string peer_visible_devices() {
  const char* v = std::getenv("FERRY_TEST_PEER_VISIBLE_DEVICES");
  return v != nullptr ? v : "";
}

// GPUs on this host, whatever this process's CUDA_VISIBLE_DEVICES hides; 0
// when the driver's /proc entries cannot be read.
int host_gpu_count() {
  int n = 0;
  if (DIR* d = opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

std::string field(const std::string& line, size_t i) {
  size_t pos = 0;
  for (size_t k = 0; k < i; ++k) {
    pos = line.find(' ', pos);
    if (pos == std::string::npos) return {};
    ++pos;
  }
  return line.substr(pos, line.find(' ', pos) - pos);
}

class CudaIpc : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    if (!cuda_available(&reason)) GTEST_SKIP() << "skipped: " << reason;
    if (gputest::peer_device() >= cuda_device_count()) {
      GTEST_SKIP() << "skipped: the target process is to use GPU " << gputest::peer_device()
                   << " (FERRY_TEST_PEER_DEVICE), this machine has " << cuda_device_count();
    }
    std::string error;
    const std::string visible = peer_visible_devices();
    if (!visible.empty()) {
      // (Where the driver's /proc entries are hidden, as in some containers,
      // the count is 0: the target then says for itself whether it has a GPU.)
      if (host_gpu_count() == 1) {
        GTEST_SKIP() << "skipped: one GPU per process needs two GPUs on this host "
                        "(/proc/driver/nvidia/gpus lists "
                     << host_gpu_count() << ")";
      }
      // The target alone gets another visible set; this process's CUDA is
      // already initialised (cuda_available above), so its own set stays.
      const char* mine = std::getenv("CUDA_VISIBLE_DEVICES");
      const std::string saved = mine != nullptr ? mine : "";
      setenv("CUDA_VISIBLE_DEVICES", visible.c_str(), 1);
      const bool started = target_.start(FERRY_CUDA_IPC_PEER, 0, &error);
      if (mine != nullptr) {
        setenv("CUDA_VISIBLE_DEVICES", saved.c_str(), 1);
      } else {
        unsetenv("CUDA_VISIBLE_DEVICES");
      }
      ASSERT_TRUE(started) << error;
    } else {
      ASSERT_TRUE(target_.start(FERRY_CUDA_IPC_PEER, 0, &error)) << error;
    }
    ASSERT_EQ(target_.ready_fields().size(), 2u);
    auto e = Engine::create();
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    engine_ = std::move(e.value());
    auto peer = engine_->connect(gputest::unhex(target_.ready_fields()[1]));
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    peer_ = *peer;
    ASSERT_EQ(cudaMalloc(&gpu_, kLocalSize), cudaSuccess);
    ASSERT_EQ(cudaMallocHost(&pinned_, kLocalSize), cudaSuccess);
    pageable_.resize(kLocalSize);
    for (void* p : {gpu_, pinned_, static_cast<void*>(pageable_.data())}) {
      auto r = engine_->register_memory(p, kLocalSize);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
    }
  }
  void TearDown() override {
    engine_.reset();
    if (gpu_) cudaFree(gpu_);
    if (pinned_) cudaFreeHost(pinned_);
  }

  // Allocates a target buffer; returns its descriptor.
  RemoteDescriptor alloc(const std::string& name, const std::string& kind, size_t size,
                         size_t off = 0, size_t len = 0) {
    std::string cmd = "alloc " + name + " " + kind + " " + std::to_string(size);
    if (len != 0) cmd += " " + std::to_string(off) + " " + std::to_string(len);
    const std::string answer = target_.ask(cmd);
    EXPECT_EQ(answer.rfind("desc ", 0), 0u) << answer;
    return RemoteDescriptor::from_bytes(gputest::unhex(field(answer, 1))).value();
  }
  uint64_t remote_sum(const std::string& name, uint64_t off, uint64_t len) {
    const std::string a =
        target_.ask("sum " + name + " " + std::to_string(off) + " " + std::to_string(len));
    EXPECT_EQ(a.rfind("sum ", 0), 0u) << a;
    return std::stoull(field(a, 1));
  }

  uint8_t* local(const std::string& kind) {
    if (kind == "gpu") return static_cast<uint8_t*>(gpu_);
    if (kind == "pinned") return static_cast<uint8_t*>(pinned_);
    return pageable_.data();
  }
  void put_local(const std::string& kind, const std::vector<uint8_t>& image) {
    if (kind == "gpu") {
      ASSERT_EQ(cudaMemcpy(gpu_, image.data(), image.size(), cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      std::copy(image.begin(), image.end(), local(kind));
    }
  }
  std::vector<uint8_t> get_local(const std::string& kind, size_t n) {
    std::vector<uint8_t> out(n);
    if (kind == "gpu") {
      EXPECT_EQ(cudaMemcpy(out.data(), gpu_, n, cudaMemcpyDeviceToHost), cudaSuccess);
    } else {
      std::copy(local(kind), local(kind) + n, out.begin());
    }
    return out;
  }

  // Writes `batch` blocks of `block` bytes scattered locally (stride block+5)
  // into consecutive remote blocks, checks the target's bytes; then reads
  // them back into fresh local memory and checks those.
  // `gap` 0: blocks adjacent on both sides (the transport merges them).
  void write_read(const std::string& local_kind, const std::string& name,
                  const RemoteDescriptor& remote, uint64_t block, size_t batch, uint64_t seed,
                  uint64_t gap = 5) {
    SCOPED_TRACE(local_kind + " <-> " + name + " " + std::to_string(block) + "B x" +
                 std::to_string(batch) + " gap " + std::to_string(gap));
    const uint64_t stride = block + gap;
    ASSERT_LE(stride * batch, kLocalSize);
    ASSERT_LE(block * batch, remote.length);
    std::vector<uint8_t> image(stride * batch);
    gputest::fill(image.data(), image.size(), seed);
    put_local(local_kind, image);
    std::vector<LocalIov> l(batch);
    std::vector<RemoteIov> r(batch);
    for (size_t i = 0; i < batch; ++i) {
      l[i] = {local(local_kind) + i * stride, block};
      r[i] = {&remote, i * block, block};
    }
    Status s = engine_->write(peer_, l, r);
    ASSERT_TRUE(s.ok()) << s.to_string();
    std::vector<uint8_t> expect(block * batch);
    for (size_t i = 0; i < batch; ++i) {
      std::copy_n(image.begin() + static_cast<long>(i * stride), block,
                  expect.begin() + static_cast<long>(i * block));
    }
    EXPECT_EQ(remote_sum(name, 0, expect.size()), gputest::fnv(expect.data(), expect.size()));

    // Read back into a poisoned local buffer.
    std::vector<uint8_t> poison(stride * batch + 1, 0xA5);
    put_local(local_kind, poison);
    s = engine_->read(peer_, l, r);
    ASSERT_TRUE(s.ok()) << s.to_string();
    std::vector<uint8_t> back = get_local(local_kind, stride * batch + 1);
    for (size_t i = 0; i < batch; ++i) {
      ASSERT_EQ(0, std::memcmp(back.data() + i * stride, expect.data() + i * block, block))
          << "block " << i;
      if (gap > 0) {
        ASSERT_EQ(back[i * stride + block], 0xA5) << "gap after block " << i << " was written";
      }
    }
    if (gap == 0) {
      ASSERT_EQ(back[stride * batch], 0xA5) << "byte after the last block written";
    }
  }

  std::string carrier(const std::string& route = "peer GPU memory") {
    auto info = engine_->peer_transports(peer_);
    for (const auto& t : *info) {
      if (t.carries.find(route) != std::string::npos) return t.transport;
    }
    return "none";
  }

  gputest::TargetProcess target_;
  std::unique_ptr<Engine> engine_;
  PeerId peer_ = 0;
  void* gpu_ = nullptr;
  void* pinned_ = nullptr;
  std::vector<uint8_t> pageable_;
};

TEST_F(CudaIpc, ChosenForPeerGpuMemory) {
  EXPECT_EQ(carrier(), "cuda_ipc");
  auto info = engine_->peer_transports(peer_);
  for (const auto& t : *info) {
    if (t.transport == "cuda_ipc") {
      EXPECT_TRUE(t.connected);
      EXPECT_EQ(t.carries, "peer GPU memory, local GPU with peer host memory");
    }
  }
}

// The target's GPU memory names its GPU by PCI bus id (descriptor format 2).
// With the same GPUs visible, this process finds it at the target's ordinal;
// with one GPU visible per process, it does not see it -- and says so, in
// gpu_ordinal()'s answer and in peer_transports() -- yet cuda_ipc carries it.
TEST_F(CudaIpc, PeerGpuIsNamedByWhatItIs) {
  RemoteDescriptor d = alloc("m", "malloc", 1u << 20);
  ASSERT_EQ(d.kind, MemoryKind::kCuda);
  ASSERT_NE(d.gpu_pci, 0u) << "the descriptor does not name its GPU";
  auto ours = gpu_identities();
  ASSERT_TRUE(ours.ok()) << ours.status().to_string();
  auto ordinal = gpu_ordinal(pci_bus_id_text(d.gpu_pci));
  std::string via;
  auto transports = engine_->peer_transports(peer_);
  ASSERT_TRUE(transports.ok()) << transports.status().to_string();
  for (const auto& t : *transports) {
    if (t.transport == "cuda_ipc") via = t.via;
  }
  if (peer_visible_devices().empty()) {
    ASSERT_TRUE(ordinal.ok()) << ordinal.status().to_string();
    EXPECT_EQ(*ordinal, gputest::peer_device());
    EXPECT_EQ(via.find("not visible"), std::string::npos) << via;
  } else {
    ASSERT_FALSE(ordinal.ok()) << "this process sees the target's GPU "
                               << pci_bus_id_text(d.gpu_pci);
    EXPECT_EQ(ordinal.status().code(), StatusCode::kNotFound) << ordinal.status().to_string();
    EXPECT_NE(ordinal.status().message().find((*ours)[0].pci_bus_id), std::string::npos)
        << "the answer does not name the GPU this process sees: " << ordinal.status().message();
    EXPECT_NE(via.find("not visible here"), std::string::npos) << via;
    EXPECT_NE(via.find(pci_bus_id_text(d.gpu_pci)), std::string::npos) << via;
  }
  EXPECT_EQ(carrier(), "cuda_ipc");
  write_read("gpu", "m", d, 4096, 64, 901);
}

// ---- local GPU memory with the target's host memory: the target copies ----

TEST_F(CudaIpc, ConnectByAddressCarriesGpuMemoryByCudaIpc) {
  // A fresh engine that knows the target only by host:port: the tcp
  // handshake brings the target's metadata, so cuda_ipc connects as it does
  // with metadata passed by hand -- GPU memory never crosses loopback tcp.
  const std::string listen = target_.ask("listen");
  ASSERT_EQ(listen.rfind("listen ", 0), 0u) << listen;
  engine_.reset();
  auto e = Engine::create();
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  engine_ = std::move(e.value());
  for (void* p : {gpu_, pinned_, static_cast<void*>(pageable_.data())}) {
    auto r = engine_->register_memory(p, kLocalSize);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
  }
  auto peer = engine_->connect(std::string_view(listen.substr(7)));
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  peer_ = *peer;
  EXPECT_EQ(carrier(), "cuda_ipc");
  EXPECT_EQ(carrier("local GPU with peer host memory"), "cuda_ipc");
  const auto dev = alloc("dev", "malloc", 16u << 20);
  write_read("gpu", "dev", dev, 4096, 64, 61);
  write_read("gpu", "dev", dev, (4u << 20) + 3, 2, 62, 0);
  write_read("pinned", "dev", dev, 65536, 16, 63);
  // The accepting side initiates over cuda_ipc too: its GPU memory into ours.
  char me[17];
  std::snprintf(me, sizeof me, "%016llx", static_cast<unsigned long long>(engine_->id()));
  EXPECT_EQ(target_.ask(std::string("carrier ") + me + " peer_GPU_memory"), "carrier cuda_ipc");
}

TEST_F(CudaIpc, ChosenForLocalGpuWithPeerHostMemory) {
  EXPECT_EQ(carrier("local GPU with peer host memory"), "cuda_ipc");
}

TEST_F(CudaIpc, LocalGpuWithPeerPageableHostMemory) {
  RemoteDescriptor d = alloc("h", "host", 48u << 20);
  write_read("gpu", "h", d, 4096, 1, 101);
  write_read("gpu", "h", d, 4096, 64, 102);
  write_read("gpu", "h", d, 4096, 1000, 103);
  write_read("gpu", "h", d, 4096, 64, 104, 0);
  // More than kMaxCopySegments: several COPY_REQs, the first of 295 KB.
  write_read("gpu", "h", d, 4096, 4097, 105);
  write_read("gpu", "h", d, 4096, 10000, 106);
}

TEST_F(CudaIpc, LocalGpuWithPeerPinnedHostMemory) {
  RemoteDescriptor d = alloc("p", "pinned", 48u << 20);
  write_read("gpu", "p", d, 4096, 1, 111);
  write_read("gpu", "p", d, 4096, 64, 112);
  write_read("gpu", "p", d, 4096, 1000, 113);
  write_read("gpu", "p", d, 4096, 64, 114, 0);
  // More than kMaxCopySegments: several COPY_REQs, the first of 295 KB.
  write_read("gpu", "p", d, 4096, 4097, 115);
  write_read("gpu", "p", d, 4096, 10000, 116);
}

TEST_F(CudaIpc, LocalGpuSubAllocationWithPeerHostMemory) {
  // A region registered at an offset inside a larger cudaMalloc allocation:
  // the export is of the allocation, the copy at the region's offset in it.
  void* raw = nullptr;
  ASSERT_EQ(cudaMalloc(&raw, 8u << 20), cudaSuccess);
  auto* big = static_cast<uint8_t*>(raw);
  uint8_t* sub = big + (1u << 20) + 256;
  const size_t n = 64 * 4096;
  ASSERT_TRUE(engine_->register_memory(sub, n + 1).ok());
  for (const std::string kind : {"host", "pinned"}) {
    SCOPED_TRACE(kind);
    RemoteDescriptor d = alloc("s" + kind, kind, 1u << 20);
    std::vector<uint8_t> image(n);
    gputest::fill(image.data(), n, 121);
    ASSERT_EQ(cudaMemcpy(sub, image.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<LocalIov> l(64);
    std::vector<RemoteIov> r(64);
    for (size_t i = 0; i < 64; ++i) {
      l[i] = {sub + i * 4096, 4096};
      r[i] = {&d, (63 - i) * 4096 + 8, 4096};  // scattered, reversed
    }
    Status s = engine_->write(peer_, l, r);
    ASSERT_TRUE(s.ok()) << s.to_string();
    std::vector<uint8_t> expect(n + 8, 0);
    for (size_t i = 0; i < 64; ++i) {
      std::copy_n(image.begin() + static_cast<long>(i * 4096), 4096,
                  expect.begin() + static_cast<long>((63 - i) * 4096 + 8));
    }
    EXPECT_EQ(remote_sum("s" + kind, 8, n), gputest::fnv(expect.data() + 8, n));
    std::vector<uint8_t> poison(n + 1, 0xA5);
    ASSERT_EQ(cudaMemcpy(sub, poison.data(), n + 1, cudaMemcpyHostToDevice), cudaSuccess);
    s = engine_->read(peer_, l, r);
    ASSERT_TRUE(s.ok()) << s.to_string();
    std::vector<uint8_t> back(n + 1);
    ASSERT_EQ(cudaMemcpy(back.data(), sub, n + 1, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(0, std::memcmp(back.data(), image.data(), n));
    EXPECT_EQ(back[n], 0xA5) << "byte after the last block written";
  }
  engine_.reset();
  cudaFree(big);
}

TEST_F(CudaIpc, LocalGpuWithPeerHostMemoryOneLargeBlock) {
  const size_t n = (64u << 20) + 3;
  void* raw = nullptr;
  ASSERT_EQ(cudaMalloc(&raw, n + 1), cudaSuccess);
  auto* big = static_cast<uint8_t*>(raw);
  ASSERT_TRUE(engine_->register_memory(big, n + 1).ok());
  for (const std::string kind : {"host", "pinned"}) {
    SCOPED_TRACE(kind);
    RemoteDescriptor d = alloc("b" + kind, kind, n);
    std::vector<uint8_t> image(n);
    gputest::fill(image.data(), n, kind == "host" ? 131 : 132);
    ASSERT_EQ(cudaMemcpy(big, image.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<LocalIov> l{{big, n}};
    std::vector<RemoteIov> r{{&d, 0, n}};
    Status s = engine_->write(peer_, l, r);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(remote_sum("b" + kind, 0, n), gputest::fnv(image.data(), n));
    std::vector<uint8_t> poison(n + 1, 0xA5);
    ASSERT_EQ(cudaMemcpy(big, poison.data(), n + 1, cudaMemcpyHostToDevice), cudaSuccess);
    s = engine_->read(peer_, l, r);
    ASSERT_TRUE(s.ok()) << s.to_string();
    std::vector<uint8_t> back(n + 1);
    ASSERT_EQ(cudaMemcpy(back.data(), big, n + 1, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(0, std::memcmp(back.data(), image.data(), n));
    EXPECT_EQ(back[n], 0xA5) << "byte after the block written";
  }
  engine_.reset();
  cudaFree(big);
}

TEST_F(CudaIpc, PeerHostMemoryWrongKeyAndOutOfRangeAreRefusedByTheTarget) {
  RemoteDescriptor d = alloc("h", "host", 1u << 20);
  ASSERT_EQ(target_.ask("fill h 7"), "ok");
  std::vector<uint8_t> image(1u << 20);
  gputest::fill(image.data(), image.size(), 7);
  const uint64_t before = gputest::fnv(image.data(), image.size());

  // A forged key in one segment of a batch: nothing of the batch is written.
  RemoteDescriptor forged = d;
  forged.key ^= 1;
  std::vector<LocalIov> l{{gpu_, 4096}, {static_cast<uint8_t*>(gpu_) + 4096, 4096}};
  std::vector<RemoteIov> r{{&d, 0, 4096}, {&forged, 4096, 4096}};
  Status s = engine_->write(peer_, l, r);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  EXPECT_NE(s.message().find("refused"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find(std::to_string(d.region_id)), std::string::npos) << s.to_string();
  EXPECT_EQ(remote_sum("h", 0, image.size()), before);

  // A descriptor stretched past the region (the initiator's own check passes,
  // the target's key check over the claimed range refuses it).
  RemoteDescriptor stretched = d;
  stretched.length = d.length + 4096;
  std::vector<RemoteIov> r2{{&d, 0, 4096}, {&stretched, d.length, 4096}};
  s = engine_->write(peer_, l, r2);
  EXPECT_FALSE(s.ok()) << s.to_string();
  EXPECT_TRUE(s.code() == StatusCode::kOutOfRange || s.code() == StatusCode::kPermissionDenied)
      << s.to_string();
  EXPECT_EQ(remote_sum("h", 0, image.size()), before);

  // The genuine descriptor still works.
  write_read("gpu", "h", d, 4096, 8, 8);
}

TEST_F(CudaIpc, NotificationArrivesAfterTheDataInPeerHostMemory) {
  for (const std::string kind : {"host", "pinned"}) {
    SCOPED_TRACE(kind);
    RemoteDescriptor d = alloc("n" + kind, kind, 64u << 20);
    std::vector<uint8_t> image(64u << 20);
    gputest::fill(image.data(), image.size(), kind == "host" ? 141 : 142);
    put_local("gpu", image);
    // One request (notification carried by COPY_REQ), kMaxCopySegments (one
    // full request of 295 KB, more than a Unix socket's buffer), and more
    // (several requests, the notification follows the last answer).
    for (size_t batch : {size_t{1}, size_t{4096}, size_t{4097}, size_t{5000}, size_t{10000}}) {
      SCOPED_TRACE(batch);
      const uint64_t block = image.size() / batch / 4096 * 4096;
      ASSERT_GE(block, 4096u);
      std::vector<LocalIov> l(batch);
      std::vector<RemoteIov> r(batch);
      for (size_t i = 0; i < batch; ++i) {
        l[i] = {static_cast<uint8_t*>(gpu_) + i * block, block};
        r[i] = {&d, i * block, block};
      }
      const std::string tag = "kv-offloaded-" + kind + std::to_string(batch);
      auto id = engine_->write_async(
          peer_, l, r, ByteView(reinterpret_cast<const uint8_t*>(tag.data()), tag.size()));
      ASSERT_TRUE(id.ok()) << id.status().to_string();
      EXPECT_EQ(target_.ask("notif 10000"), "notif " + tag);
      EXPECT_EQ(remote_sum("n" + kind, 0, block * batch),
                gputest::fnv(image.data(), block * batch));
      Status s = engine_->wait(*id, std::chrono::seconds(10));
      // The first failure breaks the connection: what follows would only echo it.
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
  }
}

TEST_F(CudaIpc, PeerKilledMidCopyIntoPeerHostMemoryFailsPromptly) {
  RemoteDescriptor d = alloc("h", "host", 64u << 20);
  std::vector<LocalIov> l{{gpu_, 64u << 20}};
  std::vector<RemoteIov> r{{&d, 0, 64u << 20}};
  ASSERT_TRUE(engine_->write(peer_, l, r).ok());
  std::vector<TransferId> ids;
  for (int k = 0; k < 32; ++k) ids.push_back(engine_->write_async(peer_, l, r).value());
  target_.kill_now();
  const auto t0 = std::chrono::steady_clock::now();
  size_t disconnected = 0;
  for (TransferId id : ids) {
    Status s = engine_->wait(id, std::chrono::seconds(10));
    EXPECT_NE(s.code(), StatusCode::kTimeout) << s.to_string();
    if (s.code() == StatusCode::kPeerDisconnected) ++disconnected;
  }
  EXPECT_GT(disconnected, 0u) << "some copies must have been cut off by the kill";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  Status s = engine_->write(peer_, l, r);
  EXPECT_FALSE(s.ok());
}

TEST_F(CudaIpc, EveryLocalKindToMallocMemory) {
  RemoteDescriptor d = alloc("m", "malloc", 32u << 20);
  uint64_t seed = 1;
  for (const char* kind : {"gpu", "pinned", "pageable"}) {
    write_read(kind, "m", d, 4096, 1, seed++);
    write_read(kind, "m", d, 4096, 4096, seed++);
    write_read(kind, "m", d, 1179648, 16, seed++);
    write_read(kind, "m", d, 3, 1000, seed++);
    write_read(kind, "m", d, 65536 + 17, 100, seed++);
    write_read(kind, "m", d, 4096, 4096, seed++, /*gap=*/0);  // merged into one copy
    write_read(kind, "m", d, 1179648, 16, seed++, /*gap=*/0);
  }
}

// Local pinned memory made of two page-locked registrations back to back
// (PyTorch's pinned-memory allocator hands out such blocks): a block that
// straddles them is still copied, every byte checked.
TEST_F(CudaIpc, LocalBlockStraddlingTwoPinnedRegistrations) {
  RemoteDescriptor d = alloc("m", "malloc", 4u << 20);
  const size_t half = 1u << 20;
  void* mem = mmap(nullptr, 2 * half, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* base = static_cast<uint8_t*>(mem);
  ASSERT_EQ(cudaHostRegister(base, half, cudaHostRegisterDefault), cudaSuccess);
  ASSERT_EQ(cudaHostRegister(base + half, half, cudaHostRegisterDefault), cudaSuccess);
  auto region = engine_->register_memory(base, 2 * half);
  ASSERT_TRUE(region.ok()) << region.status().to_string();
  std::vector<uint8_t> image(2 * half);
  gputest::fill(image.data(), image.size(), 91);
  std::copy(image.begin(), image.end(), base);
  // 16 KiB blocks, one of them across the boundary; several per call so the
  // copy kernel (not only the single-block copy-engine path) is asked.
  std::vector<LocalIov> l;
  std::vector<RemoteIov> r;
  for (size_t i = 0; i < 8; ++i) {
    const size_t off = half - 4 * 16384 + 8192 + i * 16384;  // block 3 straddles
    l.push_back({base + off, 16384});
    r.push_back({&d, i * 20000, 16384});
  }
  Status s = engine_->write(peer_, l, r);
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (size_t i = 0; i < 8; ++i) {
    const size_t off = half - 4 * 16384 + 8192 + i * 16384;
    EXPECT_EQ(remote_sum("m", i * 20000, 16384), gputest::fnv(image.data() + off, 16384))
        << "block " << i;
  }
  std::fill(base, base + 2 * half, 0);
  s = engine_->read(peer_, l, r);
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (size_t i = 0; i < 8; ++i) {
    const size_t off = half - 4 * 16384 + 8192 + i * 16384;
    EXPECT_EQ(0, std::memcmp(base + off, image.data() + off, 16384)) << "block " << i;
  }
  ASSERT_TRUE(engine_->deregister_memory(region->id).ok());
  cudaHostUnregister(base);
  cudaHostUnregister(base + half);
  munmap(mem, 2 * half);
}

TEST_F(CudaIpc, SubAllocationInsideOneAllocation) {
  // Two regions inside one cudaMalloc allocation (a caching allocator's
  // blocks): each maps the same allocation at its own offset.
  RemoteDescriptor a = alloc("a", "malloc", 8u << 20, (1u << 20) + 7, 3u << 20);
  write_read("gpu", "a", a, 4096, 512, 11);
  write_read("gpu", "a", a, (3u << 20), 1, 12);
}

TEST_F(CudaIpc, VmmMemoryInTwoPieces) {
  RemoteDescriptor v = alloc("v", "vmm", 16u << 20);
  ASSERT_EQ(v.kind, MemoryKind::kCuda);
  // Blocks that cross the boundary of the two physical allocations.
  write_read("gpu", "v", v, 1u << 20, 16, 21);
  write_read("pinned", "v", v, 4096 + 3, 2000, 22);
}

TEST_F(CudaIpc, PoolMemoryIsRefusedWithTheReason) {
  RemoteDescriptor p = alloc("p", "pool", 1u << 20);
  std::vector<LocalIov> l{{gpu_, 4096}};
  std::vector<RemoteIov> r{{&p, 0, 4096}};
  Status s = engine_->write(peer_, l, r);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.to_string();
  EXPECT_NE(s.message().find("cudaMallocAsync"), std::string::npos) << s.to_string();
}

TEST_F(CudaIpc, WrongKeyIsRefusedByTheTarget) {
  RemoteDescriptor d = alloc("m", "malloc", 1u << 20);
  RemoteDescriptor forged = d;
  forged.key ^= 1;
  std::vector<LocalIov> l{{gpu_, 4096}};
  std::vector<RemoteIov> r{{&forged, 0, 4096}};
  ASSERT_TRUE(target_.ask("fill m 5") == "ok");
  Status s = engine_->write(peer_, l, r);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  std::vector<uint8_t> image(1u << 20);
  gputest::fill(image.data(), image.size(), 5);
  EXPECT_EQ(remote_sum("m", 0, image.size()), gputest::fnv(image.data(), image.size()));
  // The genuine descriptor still works.
  write_read("gpu", "m", d, 4096, 8, 6);
}

TEST_F(CudaIpc, ReadOnlyDescriptorRefusesWrites) {
  RemoteDescriptor d = alloc("m", "malloc", 1u << 20);
  RemoteDescriptor ro = d;
  ro.access = kAccessRead;  // a forged downgrade keeps the key: the target refuses it
  std::vector<LocalIov> l{{gpu_, 4096}};
  std::vector<RemoteIov> r{{&ro, 0, 4096}};
  EXPECT_EQ(engine_->write(peer_, l, r).code(), StatusCode::kPermissionDenied);
}

TEST_F(CudaIpc, FreedAndReallocatedBufferIsMappedAfresh) {
  RemoteDescriptor d = alloc("m", "malloc", 4u << 20);
  write_read("gpu", "m", d, 65536, 64, 31);
  const std::string answer = target_.ask("realloc m");
  ASSERT_EQ(answer.rfind("desc ", 0), 0u) << answer;
  RemoteDescriptor fresh = RemoteDescriptor::from_bytes(gputest::unhex(field(answer, 1))).value();
  // The old descriptor names a deregistered region.
  std::vector<LocalIov> l{{gpu_, 4096}};
  std::vector<RemoteIov> r{{&d, 0, 4096}};
  EXPECT_EQ(engine_->write(peer_, l, r).code(), StatusCode::kNotFound);
  // The new allocation (often at the same address) gets its own mapping.
  write_read("gpu", "m", fresh, 65536, 64, 32);
  write_read("pinned", "m", fresh, 4096, 1000, 33);
}

// Work queued on the legacy default stream (where PyTorch fills tensors)
// before a call runs before the call's copies: a buffer filled there just
// before a write is sent filled, and one zeroed there just before a read is
// zeroed before the read lands, not after. Long memsets ahead keep the legacy
// stream busy while the call is posted. One block (copy engine) and a
// scattered batch (copy kernel), each both ways.
TEST_F(CudaIpc, CopiesStartAfterWorkQueuedOnTheDefaultStream) {
  constexpr size_t kBlock = 4096, kBatch = 16, kStride = 2 * kBlock;
  RemoteDescriptor d = alloc("m", "malloc", 1u << 20);
  void* busy = nullptr;
  ASSERT_EQ(cudaMalloc(&busy, 256u << 20), cudaSuccess);
  for (size_t batch : {size_t{1}, kBatch}) {
    SCOPED_TRACE(std::to_string(batch) + " block(s)");
    std::vector<LocalIov> l(batch);
    std::vector<RemoteIov> r(batch);
    for (size_t i = 0; i < batch; ++i) {
      l[i] = {static_cast<uint8_t*>(gpu_) + i * kStride, kBlock};
      r[i] = {&d, i * kBlock, kBlock};
    }
    // Write: the local blocks hold 0x11 until the default stream sets 0x5A.
    ASSERT_EQ(cudaMemset(gpu_, 0x11, kStride * batch), cudaSuccess);
    testing::keep_default_stream_busy(busy, 256u << 20);
    if (HasFatalFailure()) return;
    ASSERT_EQ(cudaMemsetAsync(gpu_, 0x5A, kStride * batch, 0), cudaSuccess);
    Status s = engine_->write(peer_, l, r);
    ASSERT_TRUE(s.ok()) << s.to_string();
    std::vector<uint8_t> expect(kBlock * batch, 0x5A);
    EXPECT_EQ(remote_sum("m", 0, expect.size()), gputest::fnv(expect.data(), expect.size()));
    // Read: the remote blocks hold 0x5A; the default stream zeroes the local
    // blocks first, so they must end up 0x5A.
    testing::keep_default_stream_busy(busy, 256u << 20);
    if (HasFatalFailure()) return;
    ASSERT_EQ(cudaMemsetAsync(gpu_, 0, kStride * batch, 0), cudaSuccess);
    s = engine_->read(peer_, l, r);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> back = get_local("gpu", kStride * batch);
    for (size_t i = 0; i < batch; ++i) {
      for (size_t k = 0; k < kBlock; ++k) {
        ASSERT_EQ(back[i * kStride + k], 0x5A) << "block " << i << " byte " << k;
      }
    }
  }
  cudaFree(busy);
}

TEST_F(CudaIpc, NotificationArrivesAfterTheData) {
  RemoteDescriptor d = alloc("m", "malloc", 32u << 20);
  std::vector<uint8_t> image(32u << 20);
  gputest::fill(image.data(), image.size(), 41);
  put_local("gpu", image);
  std::vector<LocalIov> l{{gpu_, image.size()}};
  std::vector<RemoteIov> r{{&d, 0, image.size()}};
  const std::string tag = "layer-7-done";
  auto id = engine_->write_async(
      peer_, l, r, ByteView(reinterpret_cast<const uint8_t*>(tag.data()), tag.size()));
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  EXPECT_EQ(target_.ask("notif 10000"), "notif " + tag);
  // By the time the target saw the notification, every byte was there.
  EXPECT_EQ(remote_sum("m", 0, image.size()), gputest::fnv(image.data(), image.size()));
  Status s = engine_->wait(*id, std::chrono::seconds(10));
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST_F(CudaIpc, DeregistrationWaitsForCopiesInFlightThenRefuses) {
  RemoteDescriptor d = alloc("m", "malloc", 64u << 20);
  std::vector<LocalIov> l;
  std::vector<RemoteIov> r;
  for (size_t i = 0; i < 64; ++i) {
    l.push_back({static_cast<uint8_t*>(gpu_) + (i % 63) * (1u << 20), 1u << 20});
    r.push_back({&d, i * (1u << 20), 1u << 20});
  }
  // Map it first, then keep copies going while the target deregisters.
  ASSERT_TRUE(engine_->write(peer_, l, r).ok());
  std::vector<TransferId> ids;
  for (int k = 0; k < 32; ++k) {
    auto id = engine_->write_async(peer_, l, r);
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  const std::string answer = target_.ask("dereg m");
  EXPECT_EQ(answer.rfind("ok ", 0), 0u) << answer;
  for (TransferId id : ids) {
    Status s = engine_->wait(id, std::chrono::seconds(30));
    EXPECT_TRUE(s.ok()) << s.to_string();  // posted before the revoke: completed
  }
  Status after = engine_->write(peer_, l, r);
  EXPECT_EQ(after.code(), StatusCode::kNotFound) << after.to_string();
}

TEST_F(CudaIpc, PeerKilledMidCopyFailsTransfersPromptly) {
  RemoteDescriptor d = alloc("m", "malloc", 64u << 20);
  std::vector<LocalIov> l{{gpu_, 64u << 20}};
  std::vector<RemoteIov> r{{&d, 0, 64u << 20}};
  ASSERT_TRUE(engine_->write(peer_, l, r).ok());
  std::vector<TransferId> ids;
  for (int k = 0; k < 64; ++k) ids.push_back(engine_->write_async(peer_, l, r).value());
  target_.kill_now();
  const auto t0 = std::chrono::steady_clock::now();
  for (TransferId id : ids) {
    Status s = engine_->wait(id, std::chrono::seconds(10));
    EXPECT_NE(s.code(), StatusCode::kTimeout) << s.to_string();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  // Later calls fail with a clear status; the engine itself goes on.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  Status s = engine_->write(peer_, l, r);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.code() == StatusCode::kPeerDisconnected || s.code() == StatusCode::kNotSupported)
      << s.to_string();
}

TEST_F(CudaIpc, ManyInFlightFromSeveralThreads) {
  RemoteDescriptor d = alloc("m", "malloc", 16u << 20);
  std::vector<uint8_t> image(16u << 20);
  gputest::fill(image.data(), image.size(), 51);
  put_local("gpu", image);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<LocalIov> l;
      std::vector<RemoteIov> r;
      const size_t quarter = (16u << 20) / 4;
      for (size_t o = 0; o < quarter; o += 4096) {
        l.push_back({static_cast<uint8_t*>(gpu_) + t * quarter + o, 4096});
        r.push_back({&d, t * quarter + o, 4096});
      }
      for (int k = 0; k < 20; ++k) {
        Status s = engine_->write(peer_, l, r);
        EXPECT_TRUE(s.ok()) << s.to_string();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(remote_sum("m", 0, image.size()), gputest::fnv(image.data(), image.size()));
}

}  // namespace
}  // namespace ferry
