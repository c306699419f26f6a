// ferry-slow-peer-bench: does a slow peer slow down the others?
//
// One initiator engine writes to K normal target processes and, in every
// other repetition, also to one slow target: a process that is stopped
// (SIGSTOP) most of the time and continued for a small share of each period
// (--duty, default 1 %), so it drains its socket at about that share of the
// rate it would have. The initiator posts to the slow peer without a limit
// of its own: the engine's per-peer window (engine.peer_window_bytes, set by
// --window) is all that bounds the work queued for it. Repetitions with and
// without the slow peer alternate (ABBA); the report is the median aggregate rate to
// the normal peers in each, their ratio, the slow peer's drain rate, and the
// initiator's RSS.
//
// Targets are forked before the initiator's engine exists (no threads yet),
// each creates its own engine; public API only. tcp only: the slow reader is
// a network peer.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "ferry/engine.h"
#include "tool_util.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  int peers = 3;
  std::string block_text = "1MiB";
  int batch = 8;
  int inflight = 4;
  double seconds = 4.0;
  int reps = 5;
  double duty = 0.01;
  int period_ms = 1000;
  std::string slow_rcvbuf = "128KiB";
  std::string window_text = "64MiB";
  std::string window_iovs = "262144";
};

struct Target {
  pid_t pid = -1;
  Bytes metadata;
  RemoteDescriptor desc;
  PeerId peer = 0;
};

bool WriteAll(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// The target process: an engine with one registered buffer; it prints
// "<metadata hex> <descriptor hex>\n" to `out` and then serves until killed.
[[noreturn]] void RunTarget(int out, uint64_t bytes, const std::string& rcvbuf) {
  EngineConfig c;
  c.listen = "127.0.0.1:0";
  c.options = {{"engine.transports", "tcp"}};
  if (!rcvbuf.empty()) c.options["tcp.rcvbuf"] = rcvbuf;
  auto e = Engine::create(c);
  if (!e.ok()) {
    std::fprintf(stderr, "target: %s\n", e.status().to_string().c_str());
    _exit(2);
  }
  std::vector<uint8_t> buf(bytes, 0x5a);
  auto region = (*e)->register_memory(buf.data(), buf.size());
  auto desc = region.ok() ? (*e)->advertise(region->id) : Result<RemoteDescriptor>(region.status());
  if (!desc.ok()) {
    std::fprintf(stderr, "target: %s\n", desc.status().to_string().c_str());
    _exit(2);
  }
  const std::string line =
      tools::to_hex((*e)->metadata()) + " " + tools::to_hex(desc->to_bytes()) + "\n";
  if (!WriteAll(out, line)) _exit(2);
  ::close(out);
  for (;;) pause();
}

bool StartTarget(uint64_t bytes, const std::string& rcvbuf, Target* t) {
  int fds[2];
  if (pipe(fds) != 0) return false;
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives the benchmark
    ::close(fds[0]);
    RunTarget(fds[1], bytes, rcvbuf);
  }
  ::close(fds[1]);
  t->pid = pid;
  std::string text;
  char chunk[4096];
  for (ssize_t n; (n = ::read(fds[0], chunk, sizeof chunk)) > 0;) text.append(chunk, n);
  ::close(fds[0]);
  const auto parts = tools::split(tools::trim(text), ' ');
  if (parts.size() != 2) return false;
  auto meta = tools::from_hex(parts[0]);
  auto desc_bytes = tools::from_hex(parts[1]);
  if (!meta || !desc_bytes) return false;
  auto desc = RemoteDescriptor::from_bytes(ByteView(*desc_bytes));
  if (!desc.ok()) return false;
  t->metadata = std::move(*meta);
  t->desc = *desc;
  return true;
}

struct Call {
  std::vector<LocalIov> local;
  std::vector<RemoteIov> remote;
};

Call MakeCall(uint8_t* local, const RemoteDescriptor* d, uint64_t block, int batch) {
  Call c;
  for (int i = 0; i < batch; ++i) {
    c.local.push_back({local + static_cast<uint64_t>(i) * block, block});
    c.remote.push_back({d, static_cast<uint64_t>(i) * block, block});
  }
  return c;
}

// Keeps `inflight` calls going to one normal peer until `stop`; counts the
// bytes of calls completed while `counting`.
void NormalPoster(Engine& e, PeerId peer, const Call& call, uint64_t call_bytes, int inflight,
                  const std::atomic<bool>& stop, const std::atomic<bool>& counting,
                  std::atomic<uint64_t>& done_bytes, std::atomic<uint64_t>& errors) {
  std::deque<TransferId> ids;
  while (!stop.load()) {
    while (static_cast<int>(ids.size()) < inflight) {
      auto id = e.write_async(peer, call.local, call.remote);
      if (!id.ok()) {
        errors.fetch_add(1);
        break;
      }
      ids.push_back(*id);
    }
    if (ids.empty()) continue;
    Status s = e.wait(ids.front(), std::chrono::seconds(30));
    ids.pop_front();
    if (!s.ok()) {
      errors.fetch_add(1);
      continue;
    }
    if (counting.load()) done_bytes.fetch_add(call_bytes);
  }
  for (TransferId id : ids) (void)e.wait(id, std::chrono::seconds(30));
}

// Posts to the slow peer as fast as the engine takes calls: only the
// window holds it back. Counts bytes completed while `counting`.
void SlowPoster(Engine& e, PeerId peer, const Call& call, uint64_t call_bytes,
                const std::atomic<bool>& stop, const std::atomic<bool>& counting,
                std::atomic<uint64_t>& done_bytes, std::atomic<uint64_t>& busy,
                std::deque<TransferId>& ids) {
  while (!stop.load()) {
    auto id = e.write_async(peer, call.local, call.remote);
    if (id.ok()) {
      ids.push_back(*id);
    } else if (id.status().code() == StatusCode::kBusy) {
      busy.fetch_add(1);
    } else {
      std::fprintf(stderr, "slow peer: %s\n", id.status().to_string().c_str());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    while (!ids.empty()) {
      Status s = e.test(ids.front());
      if (s.code() == StatusCode::kInProgress) break;
      if (s.ok() && counting.load()) done_bytes.fetch_add(call_bytes);
      ids.pop_front();
    }
  }
}

// Stops the slow target for (1 - duty) of every period.
void DutyCycle(pid_t pid, double duty, int period_ms, const std::atomic<bool>& stop) {
  const auto on = std::chrono::microseconds(static_cast<int64_t>(period_ms * 1000 * duty));
  const auto off = std::chrono::milliseconds(period_ms) - on;
  while (!stop.load()) {
    kill(pid, SIGCONT);
    std::this_thread::sleep_for(on);
    kill(pid, SIGSTOP);
    std::this_thread::sleep_for(off);
  }
  kill(pid, SIGCONT);
}

double Median(std::vector<double> v) {
  return tools::percentile(v, 0.5);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"ferry-slow-peer-bench: throughput to K peers with and without a slow peer"};
  app.add_option("--peers", o.peers, "normal peers (K)")->check(CLI::Range(1, 16));
  app.add_option("--block", o.block_text, "bytes per iov");
  app.add_option("--batch", o.batch, "iovs per call")->check(CLI::Range(1, 4096));
  app.add_option("--inflight", o.inflight, "calls in flight per normal peer")
      ->check(CLI::Range(1, 64));
  app.add_option("--seconds", o.seconds, "measured seconds per repetition");
  app.add_option("--reps", o.reps, "repetitions of each condition (alternating)");
  app.add_option("--duty", o.duty, "share of each period the slow peer runs")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--period-ms", o.period_ms, "slow peer's stop/continue period");
  app.add_option("--window", o.window_text, "engine.peer_window_bytes of the initiator");
  app.add_option("--window-iovs", o.window_iovs, "engine.peer_window_iovs of the initiator");
  app.add_option("--slow-rcvbuf", o.slow_rcvbuf,
                 "tcp.rcvbuf of the slow target (what its kernel takes while it is stopped)");
  CLI11_PARSE(app, argc, argv);
  const auto block = tools::parse_size(o.block_text);
  if (!block || *block == 0) {
    std::fprintf(stderr, "--block: not a size: %s\n", o.block_text.c_str());
    return 2;
  }
  const uint64_t call_bytes = *block * static_cast<uint64_t>(o.batch);

  std::vector<Target> targets(static_cast<size_t>(o.peers) + 1);  // the last is the slow one
  for (auto& t : targets) {
    if (!StartTarget(call_bytes, &t == &targets.back() ? o.slow_rcvbuf : std::string(), &t)) {
      std::fprintf(stderr, "could not start a target process\n");
      return 1;
    }
  }
  Target& slow = targets.back();

  EngineConfig c;
  c.listen = "127.0.0.1:0";
  // A short wait for room: the slow peer's poster comes back with Busy every
  // 100 ms instead of sleeping 10 s in a call (counted in the report).
  c.options = {{"engine.transports", "tcp"},
               {"engine.peer_window_bytes", o.window_text},
               {"engine.peer_window_iovs", o.window_iovs},
               {"engine.peer_window_wait_ms", "100"}};
  auto made = Engine::create(c);
  if (!made.ok()) {
    std::fprintf(stderr, "engine: %s\n", made.status().to_string().c_str());
    return 1;
  }
  Engine& e = **made;
  std::vector<uint8_t> local(call_bytes, 0xa5);
  auto region = e.register_memory(local.data(), local.size());
  if (!region.ok()) return 1;
  for (auto& t : targets) {
    auto p = e.connect(ByteView(t.metadata));
    if (!p.ok()) {
      std::fprintf(stderr, "connect: %s\n", p.status().to_string().c_str());
      return 1;
    }
    t.peer = *p;
  }
  std::vector<Call> calls;
  for (auto& t : targets) calls.push_back(MakeCall(local.data(), &t.desc, *block, o.batch));

  std::printf(
      "# ferry-slow-peer-bench: %d normal peers, WRITE %s x %d per call, %d in flight each; "
      "slow peer runs %.1f %% of every %d ms, tcp.rcvbuf=%s; engine.peer_window_bytes=%s, "
      "engine.peer_window_iovs=%s; %.1f s per rep, %d reps per condition, alternating\n",
      o.peers, o.block_text.c_str(), o.batch, o.inflight, o.duty * 100, o.period_ms,
      o.slow_rcvbuf.c_str(), o.window_text.c_str(), o.window_iovs.c_str(), o.seconds, o.reps);
  std::printf("%-4s %-13s %14s %14s %12s %10s %12s\n", "pair", "condition", "normal GB/s",
              "per peer GB/s", "slow MB/s", "slow busy", "RSS max MiB");

  std::vector<double> with_rates, without_rates, slow_rates, per_peer_without, pair_ratios;
  long rss_max_kib = 0;
  uint64_t errors_total = 0;
  for (int rep = 0; rep < 2 * o.reps; ++rep) {
    // ABBA order (without, with, with, without, ...): a drift of the
    // machine's load over the run favours neither condition.
    const bool with_slow = ((rep % 2) == 1) != ((rep / 2) % 2 == 1);
    std::atomic<bool> stop{false}, counting{false}, slow_stop{false};
    std::atomic<uint64_t> errors{0}, slow_busy{0}, slow_bytes{0};
    std::vector<std::atomic<uint64_t>> bytes(static_cast<size_t>(o.peers));
    std::vector<std::thread> threads;
    std::deque<TransferId> slow_ids;
    for (int i = 0; i < o.peers; ++i) {
      threads.emplace_back(NormalPoster, std::ref(e), targets[i].peer, std::cref(calls[i]),
                           call_bytes, o.inflight, std::cref(stop), std::cref(counting),
                           std::ref(bytes[i]), std::ref(errors));
    }
    std::thread duty, slow_poster;
    if (with_slow) {
      duty = std::thread(DutyCycle, slow.pid, o.duty, o.period_ms, std::cref(slow_stop));
      slow_poster = std::thread(SlowPoster, std::ref(e), slow.peer, std::cref(calls.back()),
                                call_bytes, std::cref(stop), std::cref(counting),
                                std::ref(slow_bytes), std::ref(slow_busy), std::ref(slow_ids));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // warm-up: windows fill
    counting.store(true);
    const auto t0 = Clock::now();
    long rss_kib = 0;
    while (Clock::now() - t0 < std::chrono::duration<double>(o.seconds)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      rss_kib = std::max(rss_kib, tools::proc_status_kib(0, "VmRSS"));
    }
    counting.store(false);
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    stop.store(true);
    for (auto& t : threads) t.join();
    if (with_slow) {
      slow_poster.join();
      slow_stop.store(true);
      duty.join();  // the slow peer runs again: what is queued for it drains
      // Within the window that takes well under a second; what is left after
      // 5 s (without a window: more than it drains in hours) is cancelled.
      const auto drain_end = Clock::now() + std::chrono::seconds(5);
      for (TransferId id : slow_ids) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::max(drain_end - Clock::now(), Clock::duration::zero()));
        if (e.wait(id, left).code() == StatusCode::kTimeout) {
          (void)e.cancel(id);
          (void)e.test(id);
        }
      }
      slow_ids.clear();
    }
    uint64_t total = 0;
    for (auto& b : bytes) total += b.load();
    const double rate = total / elapsed / 1e9;
    const double slow_rate = slow_bytes.load() / elapsed / 1e6;
    (with_slow ? with_rates : without_rates).push_back(rate);
    if (rep % 2 == 1) {  // a pair is complete: its own ratio
      const double other = with_slow ? without_rates.back() : with_rates.back();
      pair_ratios.push_back(with_slow ? rate / other : other / rate);
    }
    if (with_slow) slow_rates.push_back(slow_rate);
    if (!with_slow) per_peer_without.push_back(rate / o.peers);
    rss_max_kib = std::max(rss_max_kib, rss_kib);
    errors_total += errors.load();
    std::printf("%-4d %-13s %14.3f %14.3f %12s %10llu %12.1f\n", rep / 2 + 1,
                with_slow ? "with slow" : "without slow", rate, rate / o.peers,
                with_slow ? std::to_string(slow_rate).substr(0, 7).c_str() : "-",
                static_cast<unsigned long long>(slow_busy.load()), rss_kib / 1024.0);
    std::fflush(stdout);
  }

  const double with_m = Median(with_rates), without_m = Median(without_rates);
  const double slow_m = Median(slow_rates), line_m = Median(per_peer_without) * 1e3;
  std::printf(
      "\nnormal peers, median GB/s: without slow peer %.3f, with slow peer %.3f, ratio "
      "with/without %.3f\n",
      without_m, with_m, without_m > 0 ? with_m / without_m : 0.0);
  std::printf("ratio with/without of each adjacent pair: median %.3f, min %.3f, max %.3f\n",
              Median(pair_ratios), *std::min_element(pair_ratios.begin(), pair_ratios.end()),
              *std::max_element(pair_ratios.begin(), pair_ratios.end()));
  std::printf(
      "slow peer drained %.1f MB/s median = %.2f %% of one normal peer's rate without it "
      "(%.1f MB/s)\n",
      slow_m, line_m > 0 ? 100.0 * slow_m / line_m : 0.0, line_m);
  std::printf("initiator RSS max %.1f MiB; errors %llu\n", rss_max_kib / 1024.0,
              static_cast<unsigned long long>(errors_total));
  for (auto& t : targets) {
    kill(t.pid, SIGCONT);
    kill(t.pid, SIGKILL);
    waitpid(t.pid, nullptr, 0);
  }
  return errors_total == 0 ? 0 : 1;
}
