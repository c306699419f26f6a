// Target process for tcp_gpu_memory_test: owns one GPU buffer (cudaMalloc)
// and one host buffer, registers and advertises both, prints
//   ready META_HEX GPU_DESC_HEX HOST_DESC_HEX
// then answers commands on stdin:
//   fill SEED            fill both buffers with the pattern of SEED
//   sum gpu|host OFF LEN FNV-1a of the bytes (GPU bytes copied out first)
//   exit
#include <cuda_runtime_api.h>

#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/engine.h"
#include "tcp_gpu_common.h"

using namespace ferry;

int main(int argc, char** argv) {
  const size_t size = argc > 1 ? std::stoull(argv[1]) : (64u << 20);
  if (cudaSetDevice(gputest::peer_device()) != cudaSuccess) {
    std::printf("error no CUDA device %d\n", gputest::peer_device());
    return 1;
  }
  void* gpu = nullptr;
  if (cudaMalloc(&gpu, size) != cudaSuccess) {
    std::printf("error cudaMalloc\n");
    return 1;
  }
  std::vector<uint8_t> host(size);
  auto engine = Engine::create();
  if (!engine.ok()) {
    std::printf("error %s\n", engine.status().to_string().c_str());
    return 1;
  }
  auto& e = *engine.value();
  auto rg = e.register_memory(gpu, size);
  auto rh = e.register_memory(host.data(), size);
  if (!rg.ok() || !rh.ok() || rg->kind != MemoryKind::kCuda) {
    std::printf("error registration (gpu kind %s)\n",
                rg.ok() ? std::string(memory_kind_name(rg->kind)).c_str() : "?");
    return 1;
  }
  std::printf("ready %s %s %s\n", gputest::hex(e.metadata()).c_str(),
              gputest::hex(e.advertise(rg->id).value().to_bytes()).c_str(),
              gputest::hex(e.advertise(rh->id).value().to_bytes()).c_str());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "fill") {
      uint64_t seed;
      in >> seed;
      gputest::fill(host.data(), size, seed);
      cudaMemcpy(gpu, host.data(), size, cudaMemcpyHostToDevice);
      gputest::fill(host.data(), size, seed + 1);
      std::printf("ok\n");
    } else if (cmd == "sum") {
      std::string which;
      uint64_t off, len;
      in >> which >> off >> len;
      std::vector<uint8_t> copy(len);
      if (which == "gpu") {
        cudaMemcpy(copy.data(), static_cast<uint8_t*>(gpu) + off, len, cudaMemcpyDeviceToHost);
      } else {
        std::copy(host.begin() + off, host.begin() + off + len, copy.begin());
      }
      std::printf("sum %llu\n", static_cast<unsigned long long>(gputest::fnv(copy.data(), len)));
    } else if (cmd == "exit") {
      break;
    }
    std::fflush(stdout);
  }
  return 0;
}
