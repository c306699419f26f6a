// The churn process: engines destroyed with transfers in flight. Each cycle
// creates an engine, connects it to one of the workers, registers memory,
// posts writes into the worker's scratch area and reads of its static region,
// and destroys the engine without waiting for them. The process must not
// crash, and its memory and descriptors must stay flat over the cycles.
#include <signal.h>
#include <sys/prctl.h>

#include <random>
#include <sstream>
#include <thread>

#include "../integration/test_util.h"
#include "ferry/engine.h"
#include "soak_lines.h"
#include "soak_util.h"
#include "soak_worker.h"

namespace ferry::soak {

using namespace std::chrono_literals;

namespace {

struct Target {
  bool known = false;
  Bytes metadata;
  RemoteDescriptor area, fixed;
};

}  // namespace

int RunChurn(const SoakConfig& config) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  signal(SIGPIPE, SIG_IGN);
  LineWriter out;
  LineReader in;
  std::vector<Target> targets(config.processes);
  std::mt19937_64 rng(Mix64(config.seed, 0x636875726eull));
  const uint64_t size = std::min<uint64_t>(config.max_bytes, 4 << 20);
  itest::Buffer local(size);
  const uint64_t scratch =
      static_cast<uint64_t>(config.processes) * config.slots * config.max_bytes;
  std::map<std::string, uint64_t> counters;
  uint64_t rss_warm = 0;
  int fds_warm = -1;
  bool go = false, stop = false, exiting = false, done = false;
  int64_t next_report = NowNs();
  out.Write("READY churn");
  auto stats = [&] {
    std::ostringstream s;
    s << "STATS rss=" << RssBytes() << " fds=" << OpenDescriptors() << " rss_warm=" << rss_warm
      << " fds_warm=" << fds_warm;
    for (const auto& [k, v] : counters) s << ' ' << k << '=' << v;
    return s.str();
  };
  while (!exiting) {
    bool eof = false;
    const bool busy = go && !stop && counters["churn_cycles"] < uint64_t(config.churn_cycles);
    if (auto line = in.Read(busy ? 0 : 50, &eof)) {
      const auto f = itest::Split(*line);
      if (f.size() == 7 && f[0] == "PEER") {
        const int j = std::stoi(f[1]);
        auto meta = itest::FromHex(f[4]);
        auto area = itest::FromHex(f[5]);
        auto fixed = itest::FromHex(f[6]);
        if (j >= 0 && j < config.processes && meta && area && fixed) {
          auto a = RemoteDescriptor::from_bytes(ByteView(*area));
          auto x = RemoteDescriptor::from_bytes(ByteView(*fixed));
          if (a.ok() && x.ok()) targets[j] = {true, *meta, *a, *x};
        }
      } else if (!f.empty() && f[0] == "GO") {
        go = true;
      } else if (!f.empty() && f[0] == "STOP") {
        stop = true;
      } else if (!f.empty() && f[0] == "EXIT") {
        exiting = true;
      }
    }
    if (eof) break;
    if (NowNs() >= next_report) {
      next_report = NowNs() + 1'000'000'000;
      out.Write(stats());
    }
    if (stop && !done) {
      done = true;
      out.Write(stats());
      out.Write("DONE");
    }
    if (!busy) continue;

    // One cycle.
    const int t = std::uniform_int_distribution<int>(0, config.processes - 1)(rng);
    if (!targets[t].known) continue;
    EngineConfig ec;
    ec.options = config.EngineOptions();
    auto e = Engine::create(ec);
    if (!e.ok()) {
      counters["churn_create_failed"]++;
      out.Write("ERROR unexpected: churn Engine::create: " + e.status().to_string());
      continue;
    }
    std::unique_ptr<Engine> engine = std::move(e.value());
    auto peer = engine->connect(ByteView(targets[t].metadata));
    if (!peer.ok()) {
      counters["churn_connect_failed"]++;  // the worker may be being killed
      continue;
    }
    auto reg = engine->register_memory(local.data(), size);
    if (!reg.ok()) {
      counters["churn_register_failed"]++;
      out.Write("ERROR unexpected: churn register_memory: " + reg.status().to_string());
      continue;
    }
    const int n = std::uniform_int_distribution<int>(1, 16)(rng);
    for (int i = 0; i < n; ++i) {
      const uint64_t bytes = LogUniform(rng, 1, size);
      const auto pieces = RandomLayout(rng, bytes, LogUniform(rng, 1, 64));
      const bool write = i % 2 == 0;
      std::vector<LocalIov> l;
      std::vector<RemoteIov> r;
      for (const Piece& p : pieces) {
        l.push_back({local.data() + p.local, p.length});
        r.push_back({write ? &targets[t].area : &targets[t].fixed, (write ? scratch : 0) + p.remote,
                     p.length});
      }
      auto id = write ? engine->write_async(*peer, l, r) : engine->read_async(*peer, l, r);
      counters[id.ok() ? "churn_posted" : "churn_post_failed"]++;
    }
    const int us = std::uniform_int_distribution<int>(-1000, 2000)(rng);
    if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
    engine.reset();  // with transfers in flight
    if (++counters["churn_cycles"] == 20) {
      rss_warm = RssBytes();
      fds_warm = OpenDescriptors();
    }
  }
  return 0;
}

}  // namespace ferry::soak
