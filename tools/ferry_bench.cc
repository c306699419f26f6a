// ferry-bench: one-sided WRITE/READ throughput and latency between two Ferry
// engines (nixlbench / ucx_perftest-like). Uses only the public API.
//
//   ferry-bench --spawn-local --op write,read --block-size 4KiB,64KiB,1MiB,kv
//       starts a target child process on loopback and runs the initiator
//       against it, in one command.
//   ferry-bench --role target --listen 0.0.0.0:7000 --info-file /tmp/t.info
//   ferry-bench --role initiator --peer /tmp/t.info --op write --block-size 1MiB
//       the same across two hosts (copy the info file, or pass the hex line).
//
// Modes besides the throughput sweep (initiator side):
//   --post-cost N   host-side cost of posting one batch of N 4 KiB writes:
//                   time inside write_async() vs. time until completion.
//   --rss           VmRSS of both processes: idle engine, and before/after
//                   --rss-transfers (default 10^6) completed small writes.
//
// GB/s is 10^9 bytes of payload per second: all threads' bytes divided by the
// wall time from the common start to the last thread's last completion.
// Latency is per call (post to completion), in microseconds.
//
// Exit status: 0 ok, 1 usage or setup error, 2 transfer error, 3 --verify
// found wrong data.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "ferry/engine.h"
#include "tool_util.h"

namespace {

using Clock = std::chrono::steady_clock;
using ferry::tools::format_size;
using ferry::tools::parse_size;

constexpr uint64_t kKvBlock = 1179648;  // DeepSeek-R1 layer page (nixlbench kvbench)
constexpr uint64_t kKvBatch = 298;
constexpr uint64_t kSmall = 4096;        // --post-cost and --rss transfer size
constexpr uint64_t kVerifyBytesPerThread = 64ull << 20;
constexpr uint64_t kPostCostBufferCap = 64ull << 20;
constexpr const char* kReadyTag = "FERRY_TARGET";

// ---------------------------------------------------------------------------
// Options and workloads

struct Workload {
  std::string label;  // "4KiB", "kv"
  uint64_t block = 0;
  uint64_t batch = 1;
};

struct Opts {
  std::string role;
  bool spawn_local = false;
  std::string connect_by = "metadata";  // or "address"
  std::string listen = "127.0.0.1:0";
  std::string peer;
  std::string info_file;
  std::string ops = "write";
  std::string block_sizes = "4KiB,64KiB,1MiB";
  uint64_t batch = 1;
  uint64_t iters = 0;  // 0 = auto (about --time seconds per workload)
  int64_t warmup = -1;  // -1 = auto
  double time_s = 2.0;
  unsigned threads = 1;
  unsigned streams = 0;  // 0 = engine default
  unsigned depth = 1;
  std::string stride;  // default: block size (consecutive)
  std::string max_buffer = "1GiB";
  std::string buffer_size;  // target: region size (default: from the workload flags)
  std::vector<std::string> engine_opts;
  bool json = false;
  bool verify = false;
  uint64_t post_cost = 0;
  uint64_t post_cost_reps = 5;
  bool rss = false;
  uint64_t rss_transfers = 1000000;
  unsigned timeout_s = 60;
  bool forever = false;
  bool quiet = false;
};

[[noreturn]] void die(int code, const std::string& msg);

std::vector<Workload> parse_workloads(const Opts& o) {
  std::vector<Workload> out;
  for (const auto& item : ferry::tools::split(o.block_sizes, ',')) {
    if (item.empty()) continue;
    std::string lower = item;
    for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower == "kv") {
      out.push_back({"kv", kKvBlock, kKvBatch});
      continue;
    }
    auto sz = parse_size(item);
    if (!sz || *sz == 0) die(1, "bad --block-size entry '" + item + "' (want e.g. 4KiB, 1MiB, 65536, kv)");
    out.push_back({format_size(*sz), *sz, o.batch});
  }
  if (out.empty()) die(1, "--block-size names no workload");
  return out;
}

uint64_t stride_for(const Opts& o, uint64_t block) {
  if (o.stride.empty()) return block;
  auto s = parse_size(o.stride);
  if (!s || *s < block) die(1, "--stride must be a size >= the block size (" + format_size(block) + ")");
  return *s;
}

uint64_t max_buffer(const Opts& o) {
  auto m = parse_size(o.max_buffer);
  if (!m || *m == 0) die(1, "bad --max-buffer");
  return *m;
}

// Bytes one thread's slice needs for `batch` blocks of `block` at `stride`.
uint64_t slice_need(uint64_t block, uint64_t batch, uint64_t stride) {
  return (batch - 1) * stride + block;
}

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Region size (per side) that every requested workload/mode fits in; blocks
// past it wrap around.
uint64_t buffer_bytes_needed(const Opts& o) {
  const uint64_t cap = max_buffer(o);
  uint64_t need = 0;
  auto consider = [&](uint64_t block, uint64_t batch, uint64_t stride, uint64_t thread_count,
                      uint64_t mode_cap) {
    uint64_t per = slice_need(block, batch, stride);
    uint64_t total = std::min<uint64_t>(per * thread_count, mode_cap);
    total = std::max<uint64_t>(total, block * thread_count);  // at least one block per thread
    need = std::max(need, total);
  };
  const bool sweep = !(o.post_cost > 0 || o.rss);
  if (sweep) {
    for (const auto& w : parse_workloads(o)) consider(w.block, w.batch, stride_for(o, w.block), o.threads, cap);
  }
  if (o.post_cost > 0) consider(kSmall, o.post_cost, kSmall, 1, std::min(cap, kPostCostBufferCap));
  if (o.rss) consider(kSmall, 1, kSmall, 1, cap);
  return round_up(need, 4096);
}

// ---------------------------------------------------------------------------
// Process-wide state for cleanup on fatal errors

pid_t g_child = -1;
int g_child_stdin = -1;

void stop_child(bool force) {
  if (g_child <= 0) return;
  if (g_child_stdin >= 0) {
    ::close(g_child_stdin);
    g_child_stdin = -1;
  }
  if (force) ::kill(g_child, SIGTERM);
  for (int i = 0; i < 100; ++i) {  // up to 5 s
    int st = 0;
    pid_t r = ::waitpid(g_child, &st, WNOHANG);
    if (r == g_child || r < 0) {
      g_child = -1;
      return;
    }
    ::usleep(50000);
    if (i == 60) ::kill(g_child, SIGTERM);
  }
  ::kill(g_child, SIGKILL);
  ::waitpid(g_child, nullptr, 0);
  g_child = -1;
}

[[noreturn]] void die(int code, const std::string& msg) {
  std::fflush(stdout);
  std::fprintf(stderr, "ferry-bench: error: %s\n", msg.c_str());
  std::fflush(stderr);
  stop_child(true);
  // Engines may hold threads blocked on a dead peer: do not run destructors.
  std::_Exit(code);
}

void note(const Opts& o, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void note(const Opts& o, const char* fmt, ...) {
  if (o.quiet) return;
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "ferry-bench: ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
}

// ---------------------------------------------------------------------------
// Memory

struct Buffer {
  uint8_t* ptr = nullptr;
  uint64_t len = 0;
  Buffer() = default;
  explicit Buffer(uint64_t n) : len(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die(1, "cannot allocate " + format_size(n) + ": " + std::strerror(errno));
    ptr = static_cast<uint8_t*>(p);
  }
  ~Buffer() {
    if (ptr) ::munmap(ptr, len);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

void fill_random(uint8_t* p, uint64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x += 0x9E3779B97F4A7C15ull;  // splitmix64
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(p + i, &z, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(i * 131 + seed);
}

std::string status_str(const ferry::Status& s) { return s.to_string(); }

// ---------------------------------------------------------------------------
// Target

volatile sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

std::unique_ptr<ferry::Engine> make_engine(const Opts& o, const std::string& listen) {
  ferry::EngineConfig cfg;
  cfg.listen = listen;
  for (const auto& kv : o.engine_opts) {
    auto eq = kv.find('=');
    if (eq == std::string::npos) die(1, "--option wants NAME=VALUE, got '" + kv + "'");
    cfg.options[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  if (o.streams > 0) cfg.options["tcp.streams"] = std::to_string(o.streams);
  auto e = ferry::Engine::create(cfg);
  if (!e.ok()) die(1, "cannot create engine (listen " + listen + "): " + status_str(e.status()));
  return std::move(e).value();
}

int run_target(const Opts& o) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a signal interrupts the stdin read
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  auto engine = make_engine(o, o.listen);
  const long rss_idle = ferry::tools::proc_status_kib(0, "VmRSS");

  uint64_t len = 0;
  if (!o.buffer_size.empty()) {
    auto b = parse_size(o.buffer_size);
    if (!b || *b == 0) die(1, "bad --buffer-size");
    len = *b;
  } else {
    len = buffer_bytes_needed(o);
  }
  Buffer buf(len);  // not touched here: pages appear as peers write them
  auto region = engine->register_memory(buf.ptr, buf.len);
  if (!region.ok()) die(1, "register_memory(" + format_size(len) + "): " + status_str(region.status()));
  auto desc = engine->advertise(region->id, 0, UINT64_MAX, ferry::kAccessReadWrite);
  if (!desc.ok()) die(1, "advertise: " + status_str(desc.status()));
  const long rss_registered = ferry::tools::proc_status_kib(0, "VmRSS");

  std::ostringstream line;
  line << kReadyTag << " peer=" << ferry::tools::to_hex(engine->metadata()) << ":"
       << ferry::tools::to_hex(desc->to_bytes()) << " listen=" << engine->listen_address()
       << " region_bytes=" << len << " rss_idle_kib=" << rss_idle
       << " rss_registered_kib=" << rss_registered << " pid=" << ::getpid();
  std::string text = line.str();
  if (!o.info_file.empty()) {
    std::string tmp = o.info_file + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << text << "\n";
      if (!f) die(1, "cannot write --info-file " + tmp);
    }
    if (::rename(tmp.c_str(), o.info_file.c_str()) != 0)
      die(1, "cannot rename " + tmp + " to " + o.info_file + ": " + std::strerror(errno));
  }
  std::printf("%s\n", text.c_str());
  std::fflush(stdout);
  note(o, "target listening on %s, region %s, idle RSS %ld KiB; %s", engine->listen_address().c_str(),
       format_size(len).c_str(), rss_idle,
       o.forever ? "runs until SIGTERM/SIGINT" : "runs until stdin closes or SIGTERM/SIGINT");

  // Idle. Commands on stdin (one per line): "rss" -> "RSS <kib>".
  std::string pending;
  char chunk[256];
  bool stdin_open = !o.forever;
  while (!g_stop) {
    if (!stdin_open) {
      ::pause();
      continue;
    }
    ssize_t n = ::read(0, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // stdin closed
    pending.append(chunk, static_cast<size_t>(n));
    size_t nl;
    while ((nl = pending.find('\n')) != std::string::npos) {
      std::string cmd = ferry::tools::trim(pending.substr(0, nl));
      pending.erase(0, nl + 1);
      if (cmd == "rss") {
        std::printf("RSS %ld\n", ferry::tools::proc_status_kib(0, "VmRSS"));
      } else if (cmd == "quit") {
        g_stop = 1;
      } else if (!cmd.empty()) {
        std::printf("ERR unknown command '%s'\n", cmd.c_str());
      }
      std::fflush(stdout);
    }
  }
  note(o, "target exiting, RSS %ld KiB (peak %ld KiB)", ferry::tools::proc_status_kib(0, "VmRSS"),
       ferry::tools::proc_status_kib(0, "VmHWM"));
  auto st = engine->deregister_memory(region->id);
  if (!st.ok()) note(o, "deregister: %s", status_str(st).c_str());
  engine.reset();
  return 0;
}

// ---------------------------------------------------------------------------
// Peer info: "FERRY_TARGET peer=META:DESC ..." line, the bare "META:DESC", or a
// file holding either.

struct PeerInfo {
  ferry::Bytes metadata;
  ferry::RemoteDescriptor desc;
  std::string listen;  // the target's tcp address (its ready line's listen=)
  long rss_idle_kib = -1;
  long rss_registered_kib = -1;
  int pid = -1;
};

std::optional<PeerInfo> parse_peer_line(const std::string& text) {
  std::string pair;
  PeerInfo info;
  std::istringstream in(text);
  std::string tok;
  while (in >> tok) {
    if (tok.rfind("peer=", 0) == 0) pair = tok.substr(5);
    else if (tok.rfind("rss_idle_kib=", 0) == 0) info.rss_idle_kib = std::atol(tok.c_str() + 13);
    else if (tok.rfind("rss_registered_kib=", 0) == 0) info.rss_registered_kib = std::atol(tok.c_str() + 19);
    else if (tok.rfind("pid=", 0) == 0) info.pid = std::atoi(tok.c_str() + 4);
    else if (tok.rfind("listen=", 0) == 0) info.listen = tok.substr(7);
    else if (pair.empty() && tok.find(':') != std::string::npos && tok != kReadyTag) pair = tok;
  }
  auto colon = pair.find(':');
  if (colon == std::string::npos) return std::nullopt;
  auto meta = ferry::tools::from_hex(pair.substr(0, colon));
  auto d = ferry::tools::from_hex(pair.substr(colon + 1));
  if (!meta || !d) return std::nullopt;
  auto desc = ferry::RemoteDescriptor::from_bytes(*d);
  if (!desc.ok()) die(1, "peer descriptor does not decode: " + status_str(desc.status()));
  info.metadata = std::move(*meta);
  info.desc = *desc;
  return info;
}

PeerInfo resolve_peer(const std::string& arg) {
  std::string text = arg;
  struct stat st {};
  if (::stat(arg.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    std::ifstream f(arg);
    std::stringstream ss;
    ss << f.rdbuf();
    text = ss.str();
  }
  auto info = parse_peer_line(text);
  if (!info) die(1, "--peer: expected a file or text holding 'peer=METADATA_HEX:DESCRIPTOR_HEX' "
                    "(the target's ready line)");
  return std::move(*info);
}

// Starts `self --role target` with our stdout pipe; returns its ready line.
PeerInfo spawn_target(const Opts& o, uint64_t region_bytes) {
  int to_child[2], from_child[2];
  if (::pipe2(to_child, O_CLOEXEC) != 0 || ::pipe2(from_child, O_CLOEXEC) != 0)
    die(1, std::string("pipe: ") + std::strerror(errno));
  std::vector<std::string> args = {"ferry-bench", "--role", "target", "--listen", "127.0.0.1:0",
                                   "--buffer-size", std::to_string(region_bytes)};
  if (o.streams > 0) {
    args.push_back("--streams");
    args.push_back(std::to_string(o.streams));
  }
  for (const auto& kv : o.engine_opts) {
    args.push_back("--option");
    args.push_back(kv);
  }
  if (o.quiet) args.push_back("--quiet");
  pid_t pid = ::fork();
  if (pid < 0) die(1, std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::dup2(to_child[0], 0);
    ::dup2(from_child[1], 1);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv("/proc/self/exe", argv.data());
    std::fprintf(stderr, "ferry-bench: exec of target failed: %s\n", std::strerror(errno));
    std::_Exit(127);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  g_child = pid;
  g_child_stdin = to_child[1];

  std::string acc;
  auto deadline = Clock::now() + std::chrono::seconds(30);
  while (true) {
    auto nl = acc.find('\n');
    if (nl != std::string::npos) {
      std::string line = acc.substr(0, nl);
      acc.erase(0, nl + 1);
      if (line.rfind(kReadyTag, 0) == 0) {
        auto info = parse_peer_line(line);
        if (!info) die(1, "target printed a malformed ready line: " + line);
        ::close(from_child[0]);  // the child's later stdout output is not needed
        return std::move(*info);
      }
      continue;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) die(1, "target child did not become ready within 30 s");
    pollfd p{from_child[0], POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char buf[4096];
    ssize_t n = ::read(from_child[0], buf, sizeof buf);
    if (n <= 0) {
      int st = 0;
      ::waitpid(pid, &st, 0);
      g_child = -1;
      die(1, "target child exited before it was ready (status " + std::to_string(st) + ")");
    }
    acc.append(buf, static_cast<size_t>(n));
  }
}

// ---------------------------------------------------------------------------
// Initiator

struct Ctx {
  const Opts& o;
  ferry::Engine& engine;
  ferry::PeerId peer;
  const ferry::RemoteDescriptor& desc;
  ferry::MemoryRegion local;  // registered local buffer
  std::string streams_effective;
  std::string transport;  // the one carrying host memory to the peer
};

struct Layout {
  uint64_t base = 0;   // slice start (local: offset in buffer; remote: descriptor offset)
  uint64_t slots = 0;  // distinct block positions in the slice
  uint64_t stride = 0;
};

Layout slice_layout(uint64_t total, unsigned thread_count, unsigned t, uint64_t block, uint64_t stride,
                    const char* side) {
  uint64_t slice = total / thread_count / 64 * 64;
  if (slice < block)
    die(1, std::string(side) + " buffer of " + format_size(total) + " cannot hold one " + format_size(block) +
               " block per thread (" + std::to_string(thread_count) + " threads); raise --max-buffer");
  Layout l;
  l.base = slice * t;
  l.stride = stride;
  l.slots = (slice - block) / stride + 1;
  return l;
}

struct Iovs {
  std::vector<ferry::LocalIov> local;
  std::vector<ferry::RemoteIov> remote;
};

Iovs build_iovs(const Ctx& c, uint64_t block, uint64_t batch, uint64_t stride, unsigned thread_count,
                unsigned t) {
  Layout ll = slice_layout(c.local.length, thread_count, t, block, stride, "local");
  Layout rl = slice_layout(c.desc.length, thread_count, t, block, stride, "remote");
  Iovs v;
  v.local.resize(batch);
  v.remote.resize(batch);
  auto* base = static_cast<uint8_t*>(c.local.address);
  for (uint64_t j = 0; j < batch; ++j) {
    v.local[j] = {base + ll.base + (j % ll.slots) * stride, block};
    v.remote[j] = {&c.desc, rl.base + (j % rl.slots) * stride, block};
  }
  return v;
}

ferry::Result<ferry::TransferId> post(const Ctx& c, bool is_write, const Iovs& v) {
  return is_write ? c.engine.write_async(c.peer, v.local, v.remote)
                  : c.engine.read_async(c.peer, v.local, v.remote);
}

ferry::Status sync_call(const Ctx& c, bool is_write, const Iovs& v) {
  auto timeout = std::chrono::milliseconds(1000ull * c.o.timeout_s);
  return is_write ? c.engine.write(c.peer, v.local, v.remote, std::nullopt, timeout)
                  : c.engine.read(c.peer, v.local, v.remote, timeout);
}

ferry::Status wait_done(const Ctx& c, ferry::TransferId id) {
  auto st = c.engine.wait(id, std::chrono::milliseconds(1000ull * c.o.timeout_s));
  if (st.code() == ferry::StatusCode::kTimeout) {
    (void)c.engine.cancel(id);
    return ferry::err::Timeout("transfer " + std::to_string(id) + " did not finish within " +
                               std::to_string(c.o.timeout_s) + " s (" + st.message() + ")");
  }
  return st;
}

// Runs `n` calls keeping up to `depth` in flight; appends per-call latency (µs)
// to `lat` when non-null. Returns the first failure.
ferry::Status run_calls(const Ctx& c, bool is_write, const Iovs& v, uint64_t n, unsigned depth,
                        std::vector<double>* lat, const std::atomic<bool>& abort) {
  if (depth <= 1) {
    for (uint64_t i = 0; i < n && !abort.load(std::memory_order_relaxed); ++i) {
      auto t0 = Clock::now();
      auto st = sync_call(c, is_write, v);
      auto t1 = Clock::now();
      if (!st.ok()) return st;
      if (lat) lat->push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    return ferry::Status::Ok();
  }
  std::deque<std::pair<ferry::TransferId, Clock::time_point>> inflight;
  uint64_t posted = 0;
  while ((posted < n || !inflight.empty())) {
    if (abort.load(std::memory_order_relaxed)) {
      for (auto& f : inflight) (void)c.engine.cancel(f.first);
      return ferry::err::Cancelled("aborted because another thread failed");
    }
    if (posted < n && inflight.size() < depth) {
      auto t0 = Clock::now();
      auto id = post(c, is_write, v);
      if (!id.ok()) {
        for (auto& f : inflight) (void)c.engine.cancel(f.first);
        return {id.status().code(), "posting " + std::string(is_write ? "write_async" : "read_async") +
                                        " (" + std::to_string(inflight.size()) + " earlier calls in flight): " +
                                        id.status().message()};
      }
      inflight.emplace_back(*id, t0);
      ++posted;
      continue;
    }
    auto [id, t0] = inflight.front();
    inflight.pop_front();
    auto st = wait_done(c, id);
    auto t1 = Clock::now();
    if (!st.ok()) {
      for (auto& f : inflight) (void)c.engine.cancel(f.first);
      return {st.code(), "waiting for transfer " + std::to_string(id) + ": " + st.message()};
    }
    if (lat) lat->push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  return ferry::Status::Ok();
}

struct RunResult {
  std::string op;
  Workload w;
  uint64_t iters = 0;   // calls per thread, measured
  uint64_t warmup = 0;  // calls per thread
  double seconds = 0;
  double gbps = 0;
  double p50 = 0, p99 = 0, mean = 0, min = 0, max = 0;
  std::string verify = "skipped";
};

// Writes fresh data to the first blocks of each thread's slice, reads it back
// into a separate buffer and compares. Returns "ok" or dies.
std::string verify_roundtrip(const Ctx& c, const Workload& w, uint64_t stride) {
  for (unsigned t = 0; t < c.o.threads; ++t) {
    Iovs v = build_iovs(c, w.block, w.batch, stride, c.o.threads, t);
    Layout rl = slice_layout(c.desc.length, c.o.threads, t, w.block, stride, "remote");
    Layout ll = slice_layout(c.local.length, c.o.threads, t, w.block, stride, "local");
    uint64_t n = std::min({w.batch, rl.slots, ll.slots, std::max<uint64_t>(1, kVerifyBytesPerThread / w.block)});
    v.local.resize(n);
    v.remote.resize(n);
    uint64_t seed = 0xF00D + t * 7919 + w.block;
    for (uint64_t j = 0; j < n; ++j) fill_random(static_cast<uint8_t*>(v.local[j].address), w.block, seed + j);
    auto st = sync_call(c, true, v);
    if (!st.ok()) die(2, "--verify: write of " + std::to_string(n) + " x " + w.label + " failed: " + status_str(st));
    Buffer back(n * w.block);
    auto reg = c.engine.register_memory(back.ptr, back.len);
    if (!reg.ok()) die(1, "--verify: register_memory: " + status_str(reg.status()));
    Iovs r = v;
    for (uint64_t j = 0; j < n; ++j) r.local[j] = {back.ptr + j * w.block, w.block};
    st = sync_call(c, false, r);
    if (!st.ok()) die(2, "--verify: read back of " + std::to_string(n) + " x " + w.label + " failed: " + status_str(st));
    for (uint64_t j = 0; j < n; ++j) {
      if (std::memcmp(back.ptr + j * w.block, v.local[j].address, w.block) != 0) {
        uint64_t k = 0;
        auto* a = back.ptr + j * w.block;
        auto* b = static_cast<uint8_t*>(v.local[j].address);
        while (k < w.block && a[k] == b[k]) ++k;
        std::fflush(stdout);
        std::fprintf(stderr,
                     "ferry-bench: error: --verify: thread %u block %" PRIu64 " (remote offset %" PRIu64
                     ") differs at byte %" PRIu64 ": wrote 0x%02x, read back 0x%02x\n",
                     t, j, v.remote[j].offset, k, b[k], a[k]);
        stop_child(true);
        std::_Exit(3);
      }
    }
    st = c.engine.deregister_memory(reg->id);
    if (!st.ok()) die(1, "--verify: deregister_memory: " + status_str(st));
  }
  return "ok";
}

RunResult run_workload(const Ctx& c, const std::string& op, const Workload& w) {
  const Opts& o = c.o;
  const bool is_write = op == "write";
  const uint64_t stride = stride_for(o, w.block);
  const unsigned T = o.threads;
  std::vector<Iovs> iovs;
  for (unsigned t = 0; t < T; ++t) iovs.push_back(build_iovs(c, w.block, w.batch, stride, T, t));

  std::atomic<bool> abort{false};
  std::mutex err_mu;
  ferry::Status first_err;
  auto fail = [&](const ferry::Status& s) {
    std::lock_guard<std::mutex> g(err_mu);
    if (first_err.ok()) first_err = s;
    abort = true;
  };

  std::vector<double> warm_per_call(T, 0.0);
  std::vector<uint64_t> warm_calls(T, 0);
  uint64_t iters = o.iters;
  auto decide = [&]() noexcept {
    if (o.iters > 0) return;
    double worst = 0;
    for (double d : warm_per_call) worst = std::max(worst, d);
    double per = worst > 0 ? worst : 1e-3;
    double want = o.time_s / per;
    iters = static_cast<uint64_t>(std::clamp(want, 5.0, 2e6));
  };
  std::barrier sync_point(static_cast<std::ptrdiff_t>(T) + 1, decide);
  std::vector<std::vector<double>> lats(T);
  std::vector<Clock::time_point> ends(T);
  Clock::time_point start;

  std::vector<std::thread> workers;
  for (unsigned t = 0; t < T; ++t) {
    workers.emplace_back([&, t] {
      // Warmup: the given count, or about 0.3 s (at least 2 calls, at most 2000).
      auto w0 = Clock::now();
      uint64_t done = 0;
      if (o.warmup >= 0) {
        auto st = run_calls(c, is_write, iovs[t], static_cast<uint64_t>(o.warmup), o.depth, nullptr, abort);
        if (!st.ok()) fail(st);
        done = static_cast<uint64_t>(o.warmup);
      } else {
        while (!abort && (done < 2 || (Clock::now() - w0 < std::chrono::milliseconds(300) && done < 2000))) {
          auto st = run_calls(c, is_write, iovs[t], std::max<unsigned>(1, o.depth), o.depth, nullptr, abort);
          if (!st.ok()) {
            fail(st);
            break;
          }
          done += std::max<unsigned>(1, o.depth);
        }
      }
      warm_calls[t] = done;
      double el = std::chrono::duration<double>(Clock::now() - w0).count();
      warm_per_call[t] = done > 0 ? el / static_cast<double>(done) : 0;
      sync_point.arrive_and_wait();  // iters decided here
      sync_point.arrive_and_wait();  // common start
      lats[t].reserve(iters);
      if (!abort) {
        auto st = run_calls(c, is_write, iovs[t], iters, o.depth, &lats[t], abort);
        if (!st.ok()) fail(st);
      }
      ends[t] = Clock::now();
    });
  }
  sync_point.arrive_and_wait();
  start = Clock::now();
  sync_point.arrive_and_wait();
  for (auto& th : workers) th.join();
  if (!first_err.ok()) {
    die(2, op + " of " + std::to_string(w.batch) + " x " + w.label + " (threads " + std::to_string(T) +
               ", depth " + std::to_string(o.depth) + ") failed: " + status_str(first_err));
  }

  Clock::time_point end = start;
  for (auto& e : ends) end = std::max(end, e);
  RunResult r;
  r.op = op;
  r.w = w;
  r.iters = iters;
  r.warmup = *std::max_element(warm_calls.begin(), warm_calls.end());
  r.seconds = std::chrono::duration<double>(end - start).count();
  std::vector<double> all;
  for (auto& l : lats) all.insert(all.end(), l.begin(), l.end());
  double bytes = static_cast<double>(all.size()) * static_cast<double>(w.block * w.batch);
  r.gbps = r.seconds > 0 ? bytes / r.seconds / 1e9 : 0;
  if (!all.empty()) {
    double sum = 0;
    for (double d : all) sum += d;
    r.mean = sum / static_cast<double>(all.size());
    r.p50 = ferry::tools::percentile(all, 0.50);
    r.p99 = ferry::tools::percentile(all, 0.99);
    r.min = all.front();
    r.max = all.back();
  }
  if (o.verify) r.verify = verify_roundtrip(c, w, stride);
  return r;
}

void print_header(const Opts& o) {
  if (o.json) return;
  std::printf("%-6s %-9s %6s %7s %5s %8s %9s %10s %10s %8s\n", "op", "block", "batch", "threads", "depth",
              "iters", "GB/s", "p50(us)", "p99(us)", "verify");
  std::fflush(stdout);
}

void print_result(const Ctx& c, const RunResult& r) {
  const Opts& o = c.o;
  if (o.json) {
    nlohmann::json j = {
        {"system", "ferry"},   {"op", r.op},
        {"transport", c.transport},
        {"workload", r.w.label}, {"block_size", r.w.block},
        {"batch", r.w.batch},  {"threads", o.threads},
        {"streams", c.streams_effective.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.streams_effective)},
        {"depth", o.depth},    {"iters", r.iters},
        {"warmup", r.warmup},  {"bytes", r.iters * o.threads * r.w.block * r.w.batch},
        {"seconds", r.seconds}, {"gbps", r.gbps},
        {"p50_us", r.p50},     {"p99_us", r.p99},
        {"mean_us", r.mean},   {"min_us", r.min},
        {"max_us", r.max},     {"verify", r.verify},
    };
    if (!c.streams_effective.empty()) {
      char* end = nullptr;
      long v = std::strtol(c.streams_effective.c_str(), &end, 10);
      if (end && *end == 0) j["streams"] = v;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%-6s %-9s %6" PRIu64 " %7u %5u %8" PRIu64 " %9.3f %10.1f %10.1f %8s\n", r.op.c_str(),
                r.w.label.c_str(), r.w.batch, o.threads, o.depth, r.iters, r.gbps, r.p50, r.p99,
                r.verify.c_str());
  }
  std::fflush(stdout);
}

// --post-cost N: one write_async of N 4 KiB iovs; time inside the call vs. total.
void run_post_cost(const Ctx& c) {
  const Opts& o = c.o;
  const uint64_t n = o.post_cost;
  Iovs v = build_iovs(c, kSmall, n, kSmall, 1, 0);
  std::vector<double> post_us, total_us;
  const std::atomic<bool> no_abort{false};
  uint64_t reps = std::max<uint64_t>(1, o.post_cost_reps);
  for (uint64_t rep = 0; rep < reps + 1; ++rep) {  // first one is warmup
    auto t0 = Clock::now();
    auto id = c.engine.write_async(c.peer, v.local, v.remote);
    auto t1 = Clock::now();
    if (!id.ok()) die(2, "--post-cost: write_async of " + std::to_string(n) + " x 4KiB: " + status_str(id.status()));
    auto st = wait_done(c, *id);
    auto t2 = Clock::now();
    if (!st.ok()) die(2, "--post-cost: write of " + std::to_string(n) + " x 4KiB: " + status_str(st));
    if (rep == 0) continue;
    post_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    total_us.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
  }
  (void)no_abort;
  double post_med = ferry::tools::percentile(post_us, 0.5);
  double total_med = ferry::tools::percentile(total_us, 0.5);
  double per_iov = post_med / static_cast<double>(n);
  double per_iov_total = total_med / static_cast<double>(n);
  double gbps = static_cast<double>(n * kSmall) / (total_med * 1e-6) / 1e9;
  if (o.json) {
    nlohmann::json j = {{"system", "ferry"},     {"mode", "post_cost"},    {"op", "write"},
                        {"block_size", kSmall},  {"batch", n},             {"iters", reps},
                        {"post_us", post_med},   {"total_us", total_med},  {"post_us_per_iov", per_iov},
                        {"total_us_per_iov", per_iov_total},               {"gbps", gbps},
                        {"post_fraction", total_med > 0 ? post_med / total_med : 0.0}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("post-cost: one write_async of %" PRIu64 " x 4KiB iovs (median of %" PRIu64 ")\n", n, reps);
    std::printf("  inside write_async: %10.1f us  = %.3f us/iov\n", post_med, per_iov);
    std::printf("  post to completion: %10.1f us  = %.3f us/iov  (%.3f GB/s)\n", total_med, per_iov_total, gbps);
    std::printf("  posting share of total: %.1f %%\n", total_med > 0 ? 100.0 * post_med / total_med : 0.0);
  }
  std::fflush(stdout);
}

// --rss: VmRSS of both sides, idle and over --rss-transfers small writes.
void run_rss(const Ctx& c, const PeerInfo& peer, long init_rss_start, long init_rss_idle) {
  const Opts& o = c.o;
  const uint64_t total = o.rss_transfers;
  const unsigned depth = std::max(1u, o.depth);
  Iovs v = build_iovs(c, kSmall, 1, kSmall, 1, 0);
  const std::atomic<bool> no_abort{false};
  auto target_rss = [&]() -> long { return peer.pid > 0 && g_child > 0 ? ferry::tools::proc_status_kib(peer.pid, "VmRSS") : -1; };
  auto self_rss = [] { return ferry::tools::proc_status_kib(0, "VmRSS"); };

  // Warm the engine's pools first so "before" is steady state.
  const uint64_t warm = std::min<uint64_t>(10000, std::max<uint64_t>(total / 100, 1));
  auto st = run_calls(c, true, v, warm, depth, nullptr, no_abort);
  if (!st.ok()) die(2, "--rss: warmup writes failed: " + status_str(st));
  long t_before = target_rss(), i_before = self_rss();
  struct Point { uint64_t done; long init; long target; };
  std::vector<Point> points{{0, i_before, t_before}};
  const uint64_t step = std::max<uint64_t>(total / 10, 1);
  uint64_t done = 0;
  auto t0 = Clock::now();
  while (done < total) {
    uint64_t n = std::min(step, total - done);
    st = run_calls(c, true, v, n, depth, nullptr, no_abort);
    if (!st.ok()) die(2, "--rss: write " + std::to_string(done) + " failed: " + status_str(st));
    done += n;
    points.push_back({done, self_rss(), target_rss()});
  }
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  long i_after = points.back().init, t_after = points.back().target;
  if (o.json) {
    nlohmann::json series = nlohmann::json::array();
    for (auto& p : points) series.push_back({{"transfers", p.done}, {"initiator_kib", p.init}, {"target_kib", p.target}});
    nlohmann::json j = {{"system", "ferry"},
                        {"mode", "rss"},
                        {"transfers", total},
                        {"block_size", kSmall},
                        {"depth", depth},
                        {"seconds", secs},
                        {"transfers_per_s", static_cast<double>(total) / secs},
                        {"initiator_start_kib", init_rss_start},
                        {"initiator_idle_kib", init_rss_idle},
                        {"target_idle_kib", peer.rss_idle_kib},
                        {"target_registered_kib", peer.rss_registered_kib},
                        {"initiator_before_kib", i_before},
                        {"initiator_after_kib", i_after},
                        {"target_before_kib", t_before},
                        {"target_after_kib", t_after},
                        {"series", series}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("RSS (VmRSS, KiB)                    initiator     target\n");
    std::printf("  process start (no engine)       %10ld          -\n", init_rss_start);
    std::printf("  idle engine (created, listening) %9ld %10ld\n", init_rss_idle, peer.rss_idle_kib);
    std::printf("  + region registered (untouched)          - %10ld\n", peer.rss_registered_kib);
    std::printf("  before %" PRIu64 " x 4KiB writes (warm)  %8ld %10ld\n", total, i_before, t_before);
    for (size_t k = 1; k + 1 < points.size(); ++k)
      std::printf("    after %8" PRIu64 "                 %10ld %10ld\n", points[k].done, points[k].init, points[k].target);
    std::printf("  after %" PRIu64 " writes               %9ld %10ld   (growth %+ld / %+ld KiB)\n", total, i_after,
                t_after, i_after - i_before, t_after >= 0 && t_before >= 0 ? t_after - t_before : 0L);
    std::printf("  %.0f transfers/s (depth %u)\n", static_cast<double>(total) / secs, depth);
    if (peer.pid <= 0 || g_child <= 0) std::printf("  (target RSS over time is known only with --spawn-local)\n");
  }
  std::fflush(stdout);
}

int run_initiator(const Opts& o) {
  ::signal(SIGPIPE, SIG_IGN);
  const long rss_start = ferry::tools::proc_status_kib(0, "VmRSS");
  std::vector<std::string> ops;
  for (auto& op : ferry::tools::split(o.ops, ',')) {
    if (op.empty()) continue;
    if (op != "write" && op != "read") die(1, "--op takes write, read or write,read; got '" + op + "'");
    ops.push_back(op);
  }
  if (ops.empty()) die(1, "--op names no operation");
  const bool sweep = !(o.post_cost > 0 || o.rss);
  std::vector<Workload> workloads;
  if (sweep) workloads = parse_workloads(o);
  if (o.threads == 0) die(1, "--threads must be >= 1");
  if (o.depth == 0) die(1, "--depth must be >= 1");

  const uint64_t need = buffer_bytes_needed(o);
  PeerInfo peer;
  if (o.spawn_local) {
    peer = spawn_target(o, need);
  } else {
    if (o.peer.empty()) die(1, "--role initiator needs --peer (the target's ready line, or a file holding it)");
    peer = resolve_peer(o.peer);
  }

  std::string listen = o.listen;
  auto engine = make_engine(o, listen);
  const long rss_idle = ferry::tools::proc_status_kib(0, "VmRSS");
  std::string streams_effective;
  for (const auto& opt : engine->options())
    if (opt.name == "tcp.streams") streams_effective = opt.value;
  if (streams_effective.empty() && o.streams > 0) streams_effective = std::to_string(o.streams);
  if (streams_effective == "0") streams_effective = "auto";

  // --connect-by address: only the target's host:port, as a user who knows a peer by
  // address (the tcp handshake brings its metadata).
  if (o.connect_by == "address" && peer.listen.empty())
    die(1, "--connect-by address: the target's ready line has no listen= address");
  auto peer_id = o.connect_by == "address" ? engine->connect(std::string_view(peer.listen))
                                           : engine->connect(peer.metadata);
  if (!peer_id.ok()) die(1, "connect to target: " + status_str(peer_id.status()));

  Buffer local(need);
  fill_random(local.ptr, local.len, 42);
  auto region = engine->register_memory(local.ptr, local.len);
  if (!region.ok()) die(1, "register_memory(" + format_size(local.len) + "): " + status_str(region.status()));
  if (peer.desc.length < std::min<uint64_t>(need, 4096))
    die(1, "target region is only " + format_size(peer.desc.length) + " long");
  note(o, "connected; local %s, remote %s, streams %s", format_size(local.len).c_str(),
       format_size(peer.desc.length).c_str(), streams_effective.empty() ? "default" : streams_effective.c_str());
  // Which transport carries this host memory, and why the others do not.
  std::string carrier;
  if (auto routes = engine->peer_transports(*peer_id); routes.ok()) {
    for (const auto& t : *routes) {
      note(o, "transport %-5s %s%s%s", t.transport.c_str(), t.connected ? "connected" : "not connected",
           t.carries.empty() ? "" : (", carries " + t.carries).c_str(),
           t.reason.empty() ? "" : (" (" + t.reason + ")").c_str());
      if (t.carries.find("host") != std::string::npos) carrier = t.transport;
    }
  }

  Ctx c{o, *engine, *peer_id, peer.desc, *region, streams_effective, carrier};
  if (o.post_cost > 0) run_post_cost(c);
  if (o.rss) run_rss(c, peer, rss_start, rss_idle);
  if (sweep) {
    print_header(o);
    for (const auto& w : workloads)
      for (const auto& op : ops) print_result(c, run_workload(c, op, w));
  }

  auto st = engine->deregister_memory(region->id);
  if (!st.ok()) note(o, "deregister: %s", status_str(st).c_str());
  engine.reset();  // disconnect first, then let the target go
  stop_child(false);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Opts o;
  CLI::App app{"ferry-bench: one-sided WRITE/READ throughput and latency between two Ferry engines"};
  app.option_defaults()->always_capture_default();
  app.add_option("--role", o.role, "target or initiator")->check(CLI::IsMember({"target", "initiator"}));
  app.add_flag("--spawn-local", o.spawn_local, "start a target child on loopback and run the initiator against it");
  app.add_option("--connect-by", o.connect_by,
                 "initiator: connect with the target's metadata, or by its host:port alone "
                 "(the tcp handshake carries the metadata)")
      ->check(CLI::IsMember({"metadata", "address"}));
  app.add_option("--listen", o.listen, "address this engine listens on");
  app.add_option("--peer", o.peer, "initiator: the target's ready line 'peer=META:DESC', or a file holding it");
  app.add_option("--info-file", o.info_file, "target: also write the ready line to this file");
  app.add_option("--op", o.ops, "write, read, or write,read");
  app.add_option("--block-size,-s", o.block_sizes, "block sizes, comma list (4KiB,64KiB,1MiB,16MiB); 'kv' = 298 x 1,179,648 B per call");
  app.add_option("--batch,-b", o.batch, "iovs (blocks) per call")->check(CLI::Range(uint64_t{1}, uint64_t{1000000}));
  app.add_option("--iters,-n", o.iters, "measured calls per thread (0 = about --time seconds)");
  app.add_option("--warmup,-w", o.warmup, "warmup calls per thread (-1 = about 0.3 s)");
  app.add_option("--time", o.time_s, "seconds per workload when --iters is 0");
  app.add_option("--threads,-t", o.threads, "initiator threads, each on its own disjoint ranges");
  app.add_option("--streams", o.streams, "engine option tcp.streams on both sides (0 = engine default)");
  app.add_option("--depth,-d", o.depth, "calls in flight per thread (1 = blocking write()/read())");
  app.add_option("--stride", o.stride, "distance between consecutive blocks (default: the block size)");
  app.add_option("--max-buffer", o.max_buffer, "largest region per side; blocks past it wrap around");
  app.add_option("--buffer-size", o.buffer_size, "target: region size (default: what the workload flags need)");
  app.add_option("--option,-o", o.engine_opts, "engine option NAME=VALUE for both sides (repeatable)");
  app.add_flag("--json", o.json, "one JSON object per line instead of the table");
  app.add_flag("--verify", o.verify, "after each workload, write fresh data, read it back and compare");
  app.add_option("--post-cost", o.post_cost, "measure posting one batch of N 4 KiB writes (us per iov)");
  app.add_option("--post-cost-reps", o.post_cost_reps, "repetitions for --post-cost (median reported)");
  app.add_flag("--rss", o.rss, "report VmRSS: idle engine, before/after --rss-transfers small writes");
  app.add_option("--rss-transfers", o.rss_transfers, "completed 4 KiB writes for --rss");
  app.add_option("--timeout", o.timeout_s, "seconds one call may take before it counts as failed");
  app.add_flag("--forever", o.forever, "target: ignore stdin closing; run until SIGTERM/SIGINT");
  app.add_flag("--quiet,-q", o.quiet, "no progress notes on stderr");
  CLI11_PARSE(app, argc, argv);

  if (o.spawn_local && o.role == "target") die(1, "--spawn-local runs the initiator; do not combine it with --role target");
  if (o.role.empty() && !o.spawn_local) {
    std::fprintf(stderr, "ferry-bench: give --role target|initiator, or --spawn-local\n%s", app.help().c_str());
    return 1;
  }
  if (o.role == "target") return run_target(o);
  return run_initiator(o);
}
