// What the driver allows when each process sees only its own GPU: one
// process (CUDA_VISIBLE_DEVICES=B) exports a cudaMalloc buffer (legacy IPC
// handle) and a cuMemCreate buffer (POSIX file descriptor); another
// (CUDA_VISIBLE_DEVICES=A), which cannot see GPU B, maps both and copies
// to and from them with its own GPU: device to device by copy engine and by
// kernel, pinned host memory to and from. Every byte is checked; the exporter
// checks what the importer wrote. Bandwidth of 256 MiB copies is printed.
//
//   ferry-invisible-gpu-probe [A B [pidns]]   (default 0 1; needs two GPUs)
// pidns: the exporter also runs in a child PID namespace (`unshare --pid
// --fork --mount-proc`), as a container beside ours would.
//
// Lines "PROBE <what>: ok|FAIL ..." and a last "PROBE RESULT ok|FAIL".
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr size_t kBytes = 256u << 20;
bool g_ok = true;

void report(const char* what, bool ok, const std::string& detail = "") {
  std::printf("PROBE %s: %s%s%s\n", what, ok ? "ok" : "FAIL", detail.empty() ? "" : " ",
              detail.c_str());
  std::fflush(stdout);
  g_ok = g_ok && ok;
}

std::string cu_err(CUresult r) {
  const char* s = nullptr;
  cuGetErrorName(r, &s);
  return s ? s : "?";
}

__global__ void fill_kernel(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    p[i] = static_cast<uint8_t>((i * 131u + seed * 7u + (i >> 12)) & 0xff);
  }
}

__global__ void copy_kernel(uint4* dst, const uint4* src, size_t n16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16;
       i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

// Bytes of [0, n) that differ from the pattern of `seed`.
size_t bad_bytes(const void* dev_or_mapped, size_t n, uint32_t seed) {
  std::vector<uint8_t> h(n);
  if (cudaMemcpy(h.data(), dev_or_mapped, n, cudaMemcpyDefault) != cudaSuccess) return n;
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i)
    bad += h[i] != static_cast<uint8_t>((i * 131u + seed * 7u + (i >> 12)) & 0xff);
  return bad;
}

struct Offer {
  char uuid[16];
  cudaIpcMemHandle_t legacy;
  size_t vmm_bytes;
};

void send_fd(int sock, const void* data, size_t n, int fd) {
  msghdr m{};
  iovec v{const_cast<void*>(data), n};
  m.msg_iov = &v;
  m.msg_iovlen = 1;
  char ctl[CMSG_SPACE(sizeof(int))] = {};
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  if (sendmsg(sock, &m, 0) != static_cast<ssize_t>(n)) std::perror("sendmsg");
}

int recv_fd(int sock, void* data, size_t n) {
  msghdr m{};
  iovec v{data, n};
  m.msg_iov = &v;
  m.msg_iovlen = 1;
  char ctl[CMSG_SPACE(sizeof(int))] = {};
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  if (recvmsg(sock, &m, MSG_WAITALL) != static_cast<ssize_t>(n)) return -1;
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  int fd = -1;
  if (c != nullptr) std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

int exporter(int sock) {
  cuInit(0);
  cudaSetDevice(0);
  Offer o{};
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::memcpy(o.uuid, prop.uuid.bytes, 16);
  void* legacy = nullptr;
  cudaMalloc(&legacy, kBytes);
  fill_kernel<<<512, 256>>>(static_cast<uint8_t*>(legacy), kBytes, 1);
  cudaIpcGetMemHandle(&o.legacy, legacy);

  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle h;
  CUdeviceptr va = 0;
  o.vmm_bytes = kBytes;
  CUresult r = cuMemCreate(&h, kBytes, &p, 0);
  if (r == CUDA_SUCCESS) r = cuMemAddressReserve(&va, kBytes, 0, 0, 0);
  if (r == CUDA_SUCCESS) r = cuMemMap(va, kBytes, 0, h, 0);
  CUmemAccessDesc a{};
  a.location = p.location;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (r == CUDA_SUCCESS) r = cuMemSetAccess(va, kBytes, &a, 1);
  int fd = -1;
  if (r == CUDA_SUCCESS)
    r = cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  report("exporter: cuMemCreate + export as POSIX fd", r == CUDA_SUCCESS, cu_err(r));
  fill_kernel<<<512, 256>>>(reinterpret_cast<uint8_t*>(va), kBytes, 2);
  cudaDeviceSynchronize();
  send_fd(sock, &o, sizeof o, fd);
  char done = 0;
  if (read(sock, &done, 1) != 1) return 1;
  // The importer wrote pattern 3 (legacy) and 4 (VMM) into the second half;
  // compared with a fresh fill, as the pattern depends on the absolute index.
  std::vector<uint8_t> got(kBytes / 2), want(kBytes / 2);
  cudaMemcpy(got.data(), reinterpret_cast<uint8_t*>(va) + kBytes / 2, kBytes / 2,
             cudaMemcpyDefault);
  uint8_t* tmp = nullptr;
  cudaMalloc(&tmp, kBytes);
  fill_kernel<<<512, 256>>>(tmp, kBytes, 4);
  cudaMemcpy(want.data(), tmp + kBytes / 2, kBytes / 2, cudaMemcpyDefault);
  report("exporter sees the importer's writes (VMM)", got == want);
  {
    std::vector<uint8_t> g2(kBytes / 2), w2(kBytes / 2);
    cudaMemcpy(g2.data(), static_cast<uint8_t*>(legacy) + kBytes / 2, kBytes / 2,
               cudaMemcpyDefault);
    fill_kernel<<<512, 256>>>(tmp, kBytes, 3);
    cudaMemcpy(w2.data(), tmp + kBytes / 2, kBytes / 2, cudaMemcpyDefault);
    report("exporter sees the importer's writes (legacy)", g2 == w2);
  }
  done = g_ok ? 1 : 0;
  if (write(sock, &done, 1) != 1) return 1;
  return g_ok ? 0 : 1;
}

double gbps(size_t bytes, std::chrono::steady_clock::duration d) {
  return bytes / std::chrono::duration<double>(d).count() / 1e9;
}

// Copies between `mapped` (the peer's memory, on a GPU this process does not
// see) and local memory, checked and timed. The first half holds pattern
// `seed_in`; the second half is written with `seed_out`.
void exercise(const char* kind, uint8_t* mapped, uint32_t seed_in, uint32_t seed_out) {
  std::string k = kind;
  uint8_t *local = nullptr, *pinned = nullptr;
  cudaMalloc(&local, kBytes);
  cudaMallocHost(&pinned, kBytes);
  const size_t half = kBytes / 2;
  // What the runtime says about an address of the invisible GPU's memory
  // (a copy library classifying pointers asks this).
  cudaPointerAttributes attr{};
  cudaError_t ae = cudaPointerGetAttributes(&attr, mapped + 4096);
  std::printf(
      "PROBE %s: cudaPointerGetAttributes(mapped) -> %s type %d device %d devicePointer %s\n", kind,
      cudaGetErrorName(ae), static_cast<int>(attr.type), attr.device,
      attr.devicePointer == mapped + 4096 ? "= address" : "other");
  cudaGetLastError();
  // Device to device by copy engine, both ways.
  cudaError_t e = cudaMemcpy(local, mapped, half, cudaMemcpyDefault);
  report((k + ": copy engine, peer GPU -> our GPU").c_str(),
         e == cudaSuccess && bad_bytes(local, half, seed_in) == 0, cudaGetErrorName(e));
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 10; ++i) cudaMemcpyAsync(local, mapped, half, cudaMemcpyDefault);
  cudaDeviceSynchronize();
  std::printf("PROBE %s: 128 MiB copy-engine read %.1f GB/s\n", kind,
              gbps(10 * half, std::chrono::steady_clock::now() - t0));
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 10; ++i) cudaMemcpyAsync(mapped + half, local, half, cudaMemcpyDefault);
  cudaDeviceSynchronize();
  std::printf("PROBE %s: 128 MiB copy-engine write %.1f GB/s\n", kind,
              gbps(10 * half, std::chrono::steady_clock::now() - t0));
  // By kernel: our SMs read the peer's memory.
  cudaMemset(local, 0, half);
  copy_kernel<<<132, 512>>>(reinterpret_cast<uint4*>(local), reinterpret_cast<const uint4*>(mapped),
                            half / 16);
  e = cudaDeviceSynchronize();
  report((k + ": kernel reads peer GPU memory").c_str(),
         e == cudaSuccess && bad_bytes(local, half, seed_in) == 0, cudaGetErrorName(e));
  // Pinned host memory to and from the peer's GPU.
  e = cudaMemcpy(pinned, mapped, half, cudaMemcpyDefault);
  report((k + ": peer GPU -> our pinned host").c_str(),
         e == cudaSuccess && bad_bytes(pinned, half, seed_in) == 0, cudaGetErrorName(e));
  fill_kernel<<<512, 256>>>(local, kBytes, seed_out);
  cudaMemcpy(pinned, local, kBytes, cudaMemcpyDefault);
  e = cudaMemcpy(mapped + half, pinned + half, half / 2, cudaMemcpyDefault);  // host -> peer GPU
  cudaError_t e2 = cudaSuccess;
  copy_kernel<<<132, 512>>>(reinterpret_cast<uint4*>(mapped + half + half / 2),
                            reinterpret_cast<const uint4*>(local + half + half / 2), half / 2 / 16);
  e2 = cudaDeviceSynchronize();  // kernel writes the last quarter into the peer's GPU
  report((k + ": our pinned host -> peer GPU, kernel writes peer GPU").c_str(),
         e == cudaSuccess && e2 == cudaSuccess,
         std::string(cudaGetErrorName(e)) + "/" + cudaGetErrorName(e2));
  cudaFree(local);
  cudaFreeHost(pinned);
}

int importer(int sock) {
  cuInit(0);
  cudaSetDevice(0);
  Offer o{};
  const int fd = recv_fd(sock, &o, sizeof o);
  int n = 0;
  cudaGetDeviceCount(&n);
  bool visible = false;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, i);
    visible = visible || std::memcmp(prop.uuid.bytes, o.uuid, 16) == 0;
  }
  report("importer does not see the exporter's GPU", !visible,
         std::to_string(n) + " GPU(s) visible");

  void* legacy = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&legacy, o.legacy, cudaIpcMemLazyEnablePeerAccess);
  report("legacy: cudaIpcOpenMemHandle of an invisible GPU's memory", e == cudaSuccess,
         cudaGetErrorName(e));
  if (e == cudaSuccess) exercise("legacy", static_cast<uint8_t*>(legacy), 1, 3);

  CUmemGenericAllocationHandle h;
  CUresult r =
      cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  report("VMM: cuMemImportFromShareableHandle", r == CUDA_SUCCESS, cu_err(r));
  CUdeviceptr va = 0;
  if (r == CUDA_SUCCESS) r = cuMemAddressReserve(&va, o.vmm_bytes, 2 << 20, 0, 0);
  if (r == CUDA_SUCCESS) r = cuMemMap(va, o.vmm_bytes, 0, h, 0);
  report("VMM: cuMemMap", r == CUDA_SUCCESS, cu_err(r));
  CUmemAccessDesc a{};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = 0;  // our GPU, the one that copies
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (r == CUDA_SUCCESS) r = cuMemSetAccess(va, o.vmm_bytes, &a, 1);
  report("VMM: cuMemSetAccess for our own GPU", r == CUDA_SUCCESS, cu_err(r));
  if (r == CUDA_SUCCESS) exercise("VMM", reinterpret_cast<uint8_t*>(va), 2, 4);
  cudaDeviceSynchronize();
  char go = 1;
  if (write(sock, &go, 1) != 1 || read(sock, &go, 1) != 1) return 1;
  report("exporter's checks", go == 1);
  if (legacy) cudaIpcCloseMemHandle(legacy);
  if (va) {
    cuMemUnmap(va, o.vmm_bytes);
    cuMemRelease(h);
    cuMemAddressFree(va, o.vmm_bytes);
  }
  return g_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--exporter") == 0) return exporter(std::atoi(argv[2]));
  if (argc == 3 && std::strcmp(argv[1], "--importer") == 0) return importer(std::atoi(argv[2]));
  const std::string a = argc >= 3 ? argv[1] : "0", b = argc >= 3 ? argv[2] : "1";
  const bool pidns = argc >= 4 && std::strcmp(argv[3], "pidns") == 0;
  char self[4096] = {};
  if (readlink("/proc/self/exe", self, sizeof self - 1) <= 0) return 2;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 2;
  auto spawn = [&](const char* role, const std::string& visible, int fd) {
    const pid_t pid = fork();
    if (pid == 0) {
      setenv("CUDA_VISIBLE_DEVICES", visible.c_str(), 1);
      const std::string s = std::to_string(fd);
      if (pidns && std::strcmp(role, "--exporter") == 0) {
        execlp("unshare", "unshare", "--pid", "--fork", "--mount-proc", self, role, s.c_str(),
               static_cast<char*>(nullptr));
      } else {
        execl(self, self, role, s.c_str(), static_cast<char*>(nullptr));
      }
      _exit(127);
    }
    return pid;
  };
  std::printf("PROBE importer CUDA_VISIBLE_DEVICES=%s, exporter CUDA_VISIBLE_DEVICES=%s%s\n",
              a.c_str(), b.c_str(), pidns ? ", exporter in a child PID namespace" : "");
  std::fflush(stdout);
  const pid_t ex = spawn("--exporter", b, sv[0]);
  const pid_t im = spawn("--importer", a, sv[1]);
  int s1 = 0, s2 = 0;
  waitpid(im, &s1, 0);
  waitpid(ex, &s2, 0);
  const bool ok = WIFEXITED(s1) && WEXITSTATUS(s1) == 0 && WIFEXITED(s2) && WEXITSTATUS(s2) == 0;
  std::printf("PROBE RESULT %s\n", ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}
