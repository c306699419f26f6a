// The provider's own ceiling: a raw fi_write loop between two processes on
// one libfabric provider (FI_EP_RDM + FI_RMA), no Ferry. The parent writes
// blocks of each size into the child's registered buffer with `depth`
// writes in flight for about `seconds`, and prints GB/s per size.
//
//   raw_fi_write [provider] [depth] [seconds] [delivery|transmit] [sizes]
//
// sizes: comma-separated bytes (default 4096,65536,1048576,16777216).
// RAW_COMBINE=K (1 to 4) puts K blocks in each fi_writemsg, one local and one
// remote iov each (`depth` then counts operations: K * depth blocks in
// flight) -- what Ferry's combining of small operations does, without Ferry.
// RAW_PIN=A,B pins the writer to CPU A and the target child to CPU B (as
// bench/fabric/pinned.sh pins Ferry's two processes).
//
// Written for bench/fabric/run.sh; links libfabric directly.
#include <fcntl.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Fabric {
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_ep* ep = nullptr;
  fid_cq* cq = nullptr;
  fid_av* av = nullptr;
};

#define CHECK(call)                                                       \
  do {                                                                    \
    int r_ = static_cast<int>(call);                                      \
    if (r_ != 0) {                                                        \
      std::fprintf(stderr, "%s: %s (%d)\n", #call, fi_strerror(-r_), r_); \
      return false;                                                       \
    }                                                                     \
  } while (0)

bool open_fabric(Fabric& f, const char* provider, bool delivery) {
  fi_info* hints = fi_allocinfo();
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_MSG;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->fabric_attr->prov_name = strdup(provider);
  if (delivery) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  CHECK(fi_getinfo(FI_VERSION(1, 9), "127.0.0.1", nullptr, FI_SOURCE, hints, &f.info));
  fi_freeinfo(hints);
  CHECK(fi_fabric(f.info->fabric_attr, &f.fabric, nullptr));
  CHECK(fi_domain(f.fabric, f.info, &f.domain, nullptr));
  fi_cq_attr cq{};
  cq.format = FI_CQ_FORMAT_CONTEXT;
  CHECK(fi_cq_open(f.domain, &cq, &f.cq, nullptr));
  fi_av_attr av{};
  av.type = FI_AV_TABLE;
  CHECK(fi_av_open(f.domain, &av, &f.av, nullptr));
  CHECK(fi_endpoint(f.domain, f.info, &f.ep, nullptr));
  CHECK(fi_ep_bind(f.ep, &f.av->fid, 0));
  CHECK(fi_ep_bind(f.ep, &f.cq->fid, FI_TRANSMIT | FI_RECV));
  CHECK(fi_enable(f.ep));
  return true;
}

bool reg(Fabric& f, void* p, size_t n, uint64_t access, fid_mr** mr) {
  CHECK(fi_mr_reg(f.domain, p, n, access, 0, 1, 0, mr, nullptr));
  if (f.info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
    CHECK(fi_mr_bind(*mr, &f.ep->fid, 0));
    CHECK(fi_mr_enable(*mr));
  }
  return true;
}

struct TargetInfo {
  char name[256];
  size_t name_len;
  uint64_t key;
  uint64_t base;
};

}  // namespace

int main(int argc, char** argv) {
  const char* provider = argc > 1 ? argv[1] : "tcp;ofi_rxm";
  const int depth = argc > 2 ? std::atoi(argv[2]) : 16;
  const double seconds = argc > 3 ? std::atof(argv[3]) : 2.0;
  const bool delivery = argc > 4 ? std::string(argv[4]) == "delivery" : true;
  std::vector<size_t> sizes = {4 << 10, 64 << 10, 1 << 20, 16 << 20};
  if (argc > 5) {
    sizes.clear();
    const std::string list = argv[5];
    for (size_t pos = 0; pos <= list.size();) {
      const size_t next = std::min(list.find(',', pos), list.size());
      const size_t n = std::strtoull(list.substr(pos, next - pos).c_str(), nullptr, 10);
      if (n == 0 || n > (16u << 20)) {
        std::fprintf(stderr, "sizes: 1 to 16777216 bytes each, comma-separated\n");
        return 2;
      }
      sizes.push_back(n);
      pos = next + 1;
    }
  }
  size_t combine = 1;
  if (const char* v = std::getenv("RAW_COMBINE")) combine = std::strtoull(v, nullptr, 10);
  if (combine < 1 || combine > 4) {
    std::fprintf(stderr, "RAW_COMBINE: 1 to 4 blocks per operation\n");
    return 2;
  }
  int pin_parent = -1, pin_child = -1;
  if (const char* v = std::getenv("RAW_PIN")) std::sscanf(v, "%d,%d", &pin_parent, &pin_child);
  auto pin = [](int cpu) {
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
  };
  const size_t buf_bytes = 16 << 20;
  int to_parent[2], to_child[2];
  if (pipe(to_parent) != 0 || pipe(to_child) != 0) return 1;
  const pid_t child = fork();
  pin(child == 0 ? pin_child : pin_parent);
  if (child == 0) {
    Fabric f;
    if (!open_fabric(f, provider, delivery)) return 1;
    std::vector<char> buf(buf_bytes);
    fid_mr* mr = nullptr;
    if (!reg(f, buf.data(), buf.size(), FI_REMOTE_WRITE | FI_REMOTE_READ, &mr)) return 1;
    TargetInfo t{};
    t.name_len = sizeof t.name;
    fi_getname(&f.ep->fid, t.name, &t.name_len);
    t.key = fi_mr_key(mr);
    t.base = (f.info->domain_attr->mr_mode & FI_MR_VIRT_ADDR)
                 ? reinterpret_cast<uint64_t>(buf.data())
                 : 0;
    if (write(to_parent[1], &t, sizeof t) != sizeof t) return 1;
    // Manual progress: the target must read its CQ for writes to land.
    fcntl(to_child[0], F_SETFL, O_NONBLOCK);
    fi_cq_entry e[16];
    char c;
    while (read(to_child[0], &c, 1) != 1) fi_cq_read(f.cq, e, 16);
    return 0;
  }
  Fabric f;
  if (!open_fabric(f, provider, delivery)) return 1;
  TargetInfo t{};
  if (read(to_parent[0], &t, sizeof t) != sizeof t) return 1;
  fi_addr_t peer;
  if (fi_av_insert(f.av, t.name, 1, &peer, 0, nullptr) != 1) return 1;
  std::vector<char> src(buf_bytes, 7);
  fid_mr* lmr = nullptr;
  if (!reg(f, src.data(), src.size(), FI_WRITE, &lmr)) return 1;
  void* desc = fi_mr_desc(lmr);
  std::printf("raw fi_write, provider %s, depth %d, %s completion, %zu block(s) per operation\n",
              f.info->fabric_attr->prov_name, depth, delivery ? "delivery" : "transmit", combine);
  std::vector<fi_context2> ctx(depth);
  for (size_t size : sizes) {
    const size_t slots = buf_bytes / size;
    auto run = [&](double secs) {
      int inflight = 0;
      uint64_t done = 0, posted = 0;
      const auto start = std::chrono::steady_clock::now();
      const auto stop = start + std::chrono::duration<double>(secs);
      bool posting = true;
      while (posting || inflight > 0) {
        while (posting && inflight < depth) {
          ssize_t r;
          if (combine == 1) {  // the reference loop: one fi_write per block
            const size_t at = (posted % slots) * size;
            r = fi_write(f.ep, src.data() + at, size, desc, peer, t.base + at, t.key,
                         &ctx[posted % depth]);
          } else {
            iovec iov[4];
            void* descs[4];
            fi_rma_iov rma[4];
            for (size_t k = 0; k < combine; ++k) {
              const size_t at = ((posted * combine + k) % slots) * size;
              iov[k] = {src.data() + at, size};
              descs[k] = desc;
              rma[k] = {t.base + at, size, t.key};
            }
            fi_msg_rma msg{};
            msg.msg_iov = iov;
            msg.desc = descs;
            msg.iov_count = combine;
            msg.addr = peer;
            msg.rma_iov = rma;
            msg.rma_iov_count = combine;
            msg.context = &ctx[posted % depth];
            r = fi_writemsg(f.ep, &msg, FI_COMPLETION | (delivery ? FI_DELIVERY_COMPLETE : 0));
          }
          if (r == -FI_EAGAIN) break;
          if (r != 0) {
            std::fprintf(stderr, "fi_write: %s\n", fi_strerror(static_cast<int>(-r)));
            return -1.0;
          }
          ++posted;
          ++inflight;
        }
        fi_cq_entry e[16];
        ssize_t n = fi_cq_read(f.cq, e, 16);
        if (n > 0) {
          inflight -= static_cast<int>(n);
          done += static_cast<uint64_t>(n);
        } else if (n != -FI_EAGAIN) {
          fi_cq_err_entry err{};
          fi_cq_readerr(f.cq, &err, 0);
          std::fprintf(stderr, "completion error: %s\n", fi_strerror(err.err));
          return -1.0;
        }
        if (std::chrono::steady_clock::now() >= stop) posting = false;
      }
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return static_cast<double>(done * combine) * size / s / 1e9;
    };
    run(0.3);  // warm-up (connection set-up)
    std::printf("size %zu GB/s %.3f\n", size, run(seconds));
    std::fflush(stdout);
  }
  char c = 'q';
  if (write(to_child[1], &c, 1) != 1) return 1;
  waitpid(child, nullptr, 0);
  return 0;
}
