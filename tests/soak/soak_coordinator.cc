#include "soak_coordinator.h"

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "../integration/test_util.h"
#include "soak_util.h"

namespace ferry::soak {

using namespace std::chrono_literals;
using itest::ChildProcess;
using itest::Split;

namespace {

struct Line {
  int proc;
  uint32_t incarnation;
  std::string text;
};

// Lines of every child, in one queue.
class Inbox {
 public:
  void Push(Line l) {
    std::lock_guard<std::mutex> lock(mu_);
    lines_.push_back(std::move(l));
    cv_.notify_one();
  }
  std::optional<Line> Pop(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return !lines_.empty(); })) return std::nullopt;
    Line l = std::move(lines_.front());
    lines_.pop_front();
    return l;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Line> lines_;
};

struct Report {
  std::map<std::string, uint64_t> counters;
  Histogram latency;
  std::string carrier;
};

void Parse(const std::string& line, Report* r) {
  r->counters.clear();
  for (const std::string& kv : Split(line)) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
    if (k == "lat") {
      r->latency.Decode(v);
    } else if (k == "carrier") {
      r->carrier = v;
    } else {
      r->counters[k] = std::strtoull(v.c_str(), nullptr, 10);
    }
  }
}

bool IsGauge(const std::string& k) {
  return k == "rss" || k == "heap" || k == "fds" || k == "rss_warm" || k == "fds_warm" ||
         k.rfind("max_", 0) == 0 || k.find("_max_") != std::string::npos;
}

struct Proc {
  int index = 0;
  bool churn = false;
  uint32_t incarnation = 0;
  std::unique_ptr<ChildProcess> child;
  std::thread reader;
  std::shared_ptr<std::atomic<bool>> stop_reader;
  bool ready = false, done = false, killed = false, stopped = false, exited = false;
  int64_t restart_at = 0, cont_at = 0, started = 0;
  std::string peer_line, region_line;
  Report last;
  bool warm_taken = false;
  uint64_t rss_warm = 0, rss_last = 0;
  uint64_t heap_warm = 0, heap_last = 0;  // malloc's bytes in use (workers)
  int fds_warm = -1, fds_last = -1;
};

std::string Mib(uint64_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f", static_cast<double>(b) / (1 << 20));
  return s;
}

std::string Ms(double ns) {
  char s[32];
  std::snprintf(s, sizeof s, ns < 1e6 ? "%.0f us" : "%.1f ms", ns < 1e6 ? ns / 1e3 : ns / 1e6);
  return s;
}

class Coordinator {
 public:
  Coordinator(const SoakConfig& c, std::string self)
      : c_(c), self_(std::move(self)), rng_(c.seed) {}
  int Run();

 private:
  bool Spawn(Proc& p);
  void Reap(Proc& p, bool kill);
  void Broadcast(const std::string& line, int except, bool to_churn);
  void Handle(const Line& l);
  void Pump(std::chrono::milliseconds wait);
  void CheckDeaths();
  void Faults(int64_t now, bool allowed);
  Report Totals() const;
  void Print(bool final);
  double Since() const { return start_ == 0 ? 0.0 : static_cast<double>(NowNs() - start_) / 1e9; }
  int64_t NextAfter(double mean_s) {
    if (mean_s <= 0) return INT64_MAX;
    std::exponential_distribution<double> d(1.0 / mean_s);
    return NowNs() + static_cast<int64_t>(std::max(0.5, d(rng_)) * 1e9);
  }

  SoakConfig c_;
  std::string self_;
  std::mt19937_64 rng_;
  std::vector<std::unique_ptr<Proc>> procs_;
  Inbox inbox_;
  Report retired_;  // counters of incarnations that were killed
  int64_t start_ = 0, warm_at_ = INT64_MAX;
  uint64_t kills_ = 0, stops_ = 0, crashes_ = 0, error_lines_ = 0;
  int64_t next_kill_ = INT64_MAX, next_stop_ = INT64_MAX;
  bool traffic_ = false;
};

bool Coordinator::Spawn(Proc& p) {
  std::vector<std::string> argv = {self_};
  for (const std::string& a : c_.ToArgs()) argv.push_back(a);
  if (p.churn) {
    argv.insert(argv.end(), {"--churn", std::to_string(c_.churn_cycles), "churn"});
  } else {
    argv.insert(argv.end(), {"worker", "--index", std::to_string(p.index), "--incarnation",
                             std::to_string(p.incarnation)});
  }
  std::string error;
  p.child = ChildProcess::Spawn(argv, &error);
  if (!p.child) {
    std::fprintf(stderr, "ferry-soak: cannot start a process: %s\n", error.c_str());
    return false;
  }
  p.ready = p.done = p.killed = p.stopped = p.exited = false;
  p.warm_taken = false;
  p.rss_warm = 0;
  p.heap_warm = 0;
  p.fds_warm = -1;
  p.started = NowNs();
  p.stop_reader = std::make_shared<std::atomic<bool>>(false);
  ChildProcess* child = p.child.get();
  auto stop = p.stop_reader;
  const int index = p.index;
  const uint32_t inc = p.incarnation;
  p.reader = std::thread([this, child, stop, index, inc] {
    while (!*stop) {
      const int64_t t0 = NowNs();
      auto line = child->ReadLine(200ms);
      if (line) {
        inbox_.Push({index, inc, std::move(*line)});
      } else if (NowNs() - t0 < 150'000'000) {
        std::this_thread::sleep_for(50ms);  // end of file: the process is gone
      }
    }
  });
  return true;
}

// Ends the process (SIGKILL when `kill`), keeps what it reported.
void Coordinator::Reap(Proc& p, bool kill) {
  if (!p.child) return;
  if (kill) p.child->Kill(SIGKILL);
  (void)p.child->Wait(10s);
  *p.stop_reader = true;
  p.reader.join();
  p.child.reset();
  for (const auto& [k, v] : p.last.counters) {
    if (IsGauge(k)) {
      retired_.counters[k] = std::max(retired_.counters[k], v);
    } else {
      retired_.counters[k] += v;
    }
  }
  retired_.latency.Merge(p.last.latency);
  p.last = {};
}

void Coordinator::Broadcast(const std::string& line, int except, bool to_churn) {
  for (auto& p : procs_) {
    if (p->index == except || !p->child || (p->churn && !to_churn)) continue;
    p->child->SendLine(line);
  }
}

void Coordinator::Handle(const Line& l) {
  Proc& p = *procs_[l.proc];
  if (l.incarnation != p.incarnation) return;  // a killed incarnation's last words
  const auto f = Split(l.text);
  if (f.empty()) return;
  if (f[0] == "READY" && p.churn) {
    p.ready = true;
    for (auto& q : procs_) {
      if (!q->churn && q->ready) p.child->SendLine(q->peer_line);
    }
    if (traffic_) p.child->SendLine("GO");
  } else if (f[0] == "READY" && f.size() == 7) {
    p.ready = true;
    p.peer_line = "PEER " + f[1] + " " + f[2] + " " + f[3] + " " + f[4] + " " + f[5] + " " + f[6];
    p.region_line.clear();
    if (traffic_ || p.incarnation > 0) {
      // A restart: everyone learns of it, it learns of everyone.
      Broadcast(p.peer_line, p.index, true);
      for (auto& q : procs_) {
        if (q.get() == &p || q->churn || !q->ready) continue;
        p.child->SendLine(q->peer_line);
        if (!q->region_line.empty()) p.child->SendLine(q->region_line);
      }
      if (traffic_) p.child->SendLine("GO");
    }
  } else if (f[0] == "REGION" && f.size() == 5) {
    p.region_line = "PREGION " + std::to_string(p.index) + " " + std::to_string(p.incarnation) +
                    " " + f[1] + " " + f[2] + " " + f[3] + " " + f[4];
    Broadcast(p.region_line, p.index, false);
  } else if (f[0] == "STATS") {
    Parse(l.text, &p.last);
    p.rss_last = p.last.counters["rss"];
    p.heap_last = p.last.counters["heap"];
    p.fds_last = static_cast<int>(p.last.counters["fds"]);
    // Warm: past the run's warm-up, and up 10 s for a restarted process.
    if (!p.warm_taken && NowNs() >= warm_at_ &&
        (p.incarnation == 0 || NowNs() >= p.started + 10'000'000'000)) {
      p.warm_taken = true;
      p.rss_warm = p.rss_last;
      p.heap_warm = p.heap_last;
      p.fds_warm = p.fds_last;
    }
  } else if (f[0] == "ERROR") {
    if (error_lines_++ < 200) {
      std::fprintf(stderr, "[%6.1f s] [%s %d.%u] %s\n", Since(), p.churn ? "churn" : "process",
                   p.index, p.incarnation, l.text.c_str());
    }
  } else if (f[0] == "DONE") {
    p.done = true;
  }
}

void Coordinator::Pump(std::chrono::milliseconds wait) {
  auto l = inbox_.Pop(wait);
  while (l) {
    Handle(*l);
    l = inbox_.Pop(0ms);
  }
}

// A process that died without being killed is a crash: counted, told to the
// others as a kill (so their errors are judged as such), and restarted.
void Coordinator::CheckDeaths() {
  for (auto& pp : procs_) {
    Proc& p = *pp;
    if (!p.child || p.killed) continue;
    auto st = p.child->Wait(0ms);
    if (!st) continue;
    ++crashes_;
    std::fprintf(stderr, "ferry-soak: %s %d (incarnation %u) died: %s %d\n",
                 p.churn ? "churn process" : "process", p.index, p.incarnation,
                 WIFSIGNALED(*st) ? "signal" : "exit status",
                 WIFSIGNALED(*st) ? WTERMSIG(*st) : WEXITSTATUS(*st));
    if (!p.churn) {
      Broadcast("FAULT kill " + std::to_string(p.index) + " " + std::to_string(p.incarnation) +
                    " " + std::to_string(NowNs()),
                p.index, false);
    }
    Reap(p, false);
    p.killed = true;
    p.incarnation++;
    p.restart_at = NowNs() + 500'000'000;
  }
}

void Coordinator::Faults(int64_t now, bool allowed) {
  bool busy = false;
  for (auto& p : procs_) {
    Proc& q = *p;
    if (q.stopped && now >= q.cont_at) {
      q.child->Kill(SIGCONT);
      q.stopped = false;
      Broadcast("FAULT cont " + std::to_string(q.index) + " " + std::to_string(q.incarnation) +
                    " " + std::to_string(NowNs()),
                -1, false);
    }
    if (q.killed && now >= q.restart_at) {
      q.killed = false;
      if (!Spawn(q)) q.exited = true;
    }
    busy |= q.stopped || q.killed || (!q.churn && !q.ready);
  }
  if (!allowed || busy) return;
  const bool kill = now >= next_kill_, stop = now >= next_stop_;
  if (!kill && !stop) return;
  std::vector<Proc*> live;
  for (auto& p : procs_) {
    if (!p->churn && p->child && p->ready) live.push_back(p.get());
  }
  if (live.empty()) return;
  Proc& v = *live[std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng_)];
  if (kill) {
    next_kill_ = NextAfter(c_.kill_every);
    ++kills_;
    std::printf("[%6.1f s] fault: SIGKILL process %d (incarnation %u)\n", Since(), v.index,
                v.incarnation);
    v.child->Kill(SIGKILL);
    const int64_t at = NowNs();
    Broadcast("FAULT kill " + std::to_string(v.index) + " " + std::to_string(v.incarnation) + " " +
                  std::to_string(at),
              v.index, false);
    Reap(v, false);
    v.killed = true;
    v.incarnation++;
    v.restart_at = NowNs() + std::uniform_int_distribution<int64_t>(0, 1'000'000'000)(rng_);
  } else {
    next_stop_ = NextAfter(c_.stop_every);
    ++stops_;
    v.child->Kill(SIGSTOP);
    v.stopped = true;
    const int64_t at = NowNs();
    v.cont_at = at + int64_t{std::uniform_int_distribution<uint32_t>(
                         c_.stop_min_ms, std::max(c_.stop_min_ms, c_.stop_max_ms))(rng_)} *
                         1'000'000;
    Broadcast("FAULT stop " + std::to_string(v.index) + " " + std::to_string(v.incarnation) + " " +
                  std::to_string(at),
              -1, false);
    std::printf("[%6.1f s] fault: SIGSTOP process %d (incarnation %u) for %lld ms\n", Since(),
                v.index, v.incarnation, static_cast<long long>((v.cont_at - at) / 1'000'000));
  }
}

Report Coordinator::Totals() const {
  Report t = retired_;
  for (const auto& p : procs_) {
    for (const auto& [k, v] : p->last.counters) {
      if (IsGauge(k)) {
        t.counters[k] = std::max(t.counters[k], v);
      } else {
        t.counters[k] += v;
      }
    }
    t.latency.Merge(p->last.latency);
    if (!p->last.carrier.empty() && p->last.carrier != "-") t.carrier = p->last.carrier;
  }
  return t;
}

void Coordinator::Print(bool final) {
  Report t = Totals();
  auto& n = t.counters;
  const uint64_t transfers =
      n["writes"] + n["writes_notified"] + n["reads_slot"] + n["reads_static"] + n["reads_region"];
  const double secs = static_cast<double>(NowNs() - start_) / 1e9;
  std::printf(
      "[%6.0f s] transfers %llu (writes %llu, with notification %llu; reads of slots %llu, "
      "static %llu, registered regions %llu), %.2f GiB, over %s; latency p50 %s p99 %s\n",
      secs, (unsigned long long)transfers, (unsigned long long)n["writes"],
      (unsigned long long)n["writes_notified"], (unsigned long long)n["reads_slot"],
      (unsigned long long)n["reads_static"], (unsigned long long)n["reads_region"],
      static_cast<double>(n["bytes"]) / (1ull << 30), t.carrier.empty() ? "?" : t.carrier.c_str(),
      Ms(t.latency.Quantile(0.5)).c_str(), Ms(t.latency.Quantile(0.99)).c_str());
  std::string errors;
  for (const auto& [k, v] : n) {
    if (k.rfind("err.", 0) == 0) errors += " " + k.substr(4) + "=" + std::to_string(v);
  }
  std::printf(
      "          chosen: cancelled %llu, timed out %llu; errors by kind (code.chosen|fault|"
      "unexpected):%s\n",
      (unsigned long long)n["cancelled"], (unsigned long long)n["timed_out"],
      errors.empty() ? " none" : errors.c_str());
  std::printf(
      "          data errors %llu, notifications lost %llu, duplicated %llu (received %llu, "
      "acknowledged %llu), unexpected errors %llu, late failures %llu (slowest failure after a "
      "kill %llu ms), crashes %llu\n",
      (unsigned long long)n["data_errors"], (unsigned long long)n["notifications_lost"],
      (unsigned long long)n["notifications_duplicated"],
      (unsigned long long)n["notifications_received"],
      (unsigned long long)n["notifications_acknowledged"],
      (unsigned long long)n["unexpected_errors"], (unsigned long long)n["late_failures"],
      (unsigned long long)n["max_fail_ms"], (unsigned long long)crashes_);
  std::printf(
      "          registrations %llu, deregistrations %llu (slowest %llu us), reads of a "
      "deregistered region %llu, connects %llu; faults: %llu kills, %llu stops; churn: %llu "
      "engines destroyed with transfers in flight\n",
      (unsigned long long)n["registrations"], (unsigned long long)n["deregistrations"],
      (unsigned long long)n["deregister_max_us"],
      (unsigned long long)n["reads_of_deregistered_region"], (unsigned long long)n["connects"],
      (unsigned long long)kills_, (unsigned long long)stops_,
      (unsigned long long)n["churn_cycles"]);
  std::string per;
  for (const auto& p : procs_) {
    char s[200];
    if (final) {
      // Workers also give malloc's bytes in use: RSS that grows while these
      // stay level is memory the allocator (or a library's pool) keeps, not
      // a leak.
      char heap[64] = "";
      if (!p->churn && p->heap_last != 0) {
        std::snprintf(heap, sizeof heap, ", heap in use %s -> %s MiB", Mib(p->heap_warm).c_str(),
                      Mib(p->heap_last).c_str());
      }
      std::snprintf(s, sizeof s, " %s%d.%u: RSS %s -> %s MiB%s, fds %d -> %d;",
                    p->churn ? "churn" : "", p->index, p->incarnation,
                    Mib(p->churn ? p->last.counters["rss_warm"] : p->rss_warm).c_str(),
                    Mib(p->rss_last).c_str(), heap,
                    p->churn ? static_cast<int>(p->last.counters["fds_warm"]) : p->fds_warm,
                    p->fds_last);
    } else {
      std::snprintf(s, sizeof s, " %s%d: %s MiB %d fds;", p->churn ? "churn" : "", p->index,
                    Mib(p->rss_last).c_str(), p->fds_last);
    }
    per += s;
  }
  std::printf("          processes%s%s\n", final ? " (after warm-up -> at the end)" : "",
              per.c_str());
  (void)secs;
  std::fflush(stdout);
}

int Coordinator::Run() {
  signal(SIGPIPE, SIG_IGN);
  for (int i = 0; i < c_.processes; ++i) {
    auto p = std::make_unique<Proc>();
    p->index = i;
    procs_.push_back(std::move(p));
  }
  if (c_.churn_cycles > 0) {
    auto p = std::make_unique<Proc>();
    p->index = c_.processes;
    p->churn = true;
    procs_.push_back(std::move(p));
  }
  for (auto& p : procs_) {
    if (Spawn(*p)) continue;
    for (auto& q : procs_) Reap(*q, true);
    return 2;
  }
  // Everyone ready, then everyone told about everyone.
  const int64_t ready_by = NowNs() + 60'000'000'000;
  for (;;) {
    Pump(100ms);
    CheckDeaths();
    bool all = true;
    for (auto& p : procs_) all &= p->ready;
    if (all) break;
    if (NowNs() > ready_by || crashes_ > 0) {
      std::fprintf(stderr, "ferry-soak: the processes did not start\n");
      // Their reader threads end before the threads' objects do.
      for (auto& p : procs_) Reap(*p, true);
      return 2;
    }
  }
  for (auto& p : procs_) {
    for (auto& q : procs_) {
      if (p != q && !q->churn) p->child->SendLine(q->peer_line);
    }
  }
  start_ = NowNs();
  warm_at_ = start_ + static_cast<int64_t>(std::min(30.0, c_.seconds * 0.2) * 1e9);
  traffic_ = true;
  Broadcast("GO", -1, true);
  next_kill_ = NextAfter(c_.kill_every);
  next_stop_ = NextAfter(c_.stop_every);
  const int64_t end = start_ + static_cast<int64_t>(c_.seconds * 1e9);
  int64_t next_print = start_ + static_cast<int64_t>(c_.report_every * 1e9);
  // Traffic, then until every fault has healed (at most 60 s more).
  for (;;) {
    Pump(50ms);
    CheckDeaths();
    const int64_t now = NowNs();
    Faults(now, now < end - 3'000'000'000);
    if (now >= next_print) {
      next_print = now + static_cast<int64_t>(c_.report_every * 1e9);
      Print(false);
    }
    bool healed = true;
    for (auto& p : procs_) healed &= !p->stopped && !p->killed && p->ready;
    if (now >= end && (healed || now > end + 60'000'000'000)) break;
  }
  traffic_ = false;
  Broadcast("STOP", -1, true);
  const int64_t done_by = NowNs() + 90'000'000'000;
  for (;;) {
    Pump(100ms);
    CheckDeaths();
    bool all = true;
    for (auto& p : procs_) all &= p->done || !p->child;
    if (all || NowNs() > done_by) break;
  }
  Print(true);
  Broadcast("EXIT", -1, true);
  bool clean = true;
  for (auto& p : procs_) {
    if (!p->child) continue;
    auto st = p->child->Wait(60s);
    if (!st || !WIFEXITED(*st) || WEXITSTATUS(*st) != 0) {
      clean = false;
      std::fprintf(stderr, "ferry-soak: process %d did not exit cleanly (%s)\n", p->index,
                   st ? (WIFSIGNALED(*st) ? "signal" : "exit status") : "still running");
      p->child->Kill(SIGKILL);
    }
    *p->stop_reader = true;
    p->reader.join();
  }
  Report t = Totals();
  auto& n = t.counters;
  const uint64_t transfers =
      n["writes"] + n["writes_notified"] + n["reads_slot"] + n["reads_static"] + n["reads_region"];
  const bool pass = clean && crashes_ == 0 && transfers > 0 && n["data_errors"] == 0 &&
                    n["notifications_lost"] == 0 && n["notifications_duplicated"] == 0 &&
                    n["unexpected_errors"] == 0 && n["late_failures"] == 0 &&
                    n["carrier_mismatch"] == 0 && n["churn_create_failed"] == 0 &&
                    n["churn_register_failed"] == 0 &&
                    (c_.churn_cycles == 0 || n["churn_cycles"] > 0);
  std::printf("ferry-soak: %s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

}  // namespace

int RunCoordinator(const SoakConfig& config, const std::string& self) {
  Coordinator c(config, self);
  return c.Run();
}

}  // namespace ferry::soak
