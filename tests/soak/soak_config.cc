#include "soak_config.h"

#include <CLI/CLI.hpp>
#include <sstream>

namespace ferry::soak {

std::map<std::string, std::string> SoakConfig::EngineOptions() const {
  std::map<std::string, std::string> o;
  // How the existing suites force each transport (tests/integration/CMakeLists.txt).
  if (transport == "tcp") {
    o["engine.transports"] = "tcp";
  } else if (transport == "shm-cma") {
    o["engine.transports"] = "shm,tcp";
    o["shm.mode"] = "cma";
  } else if (transport == "shm-staging") {
    o["engine.transports"] = "shm,tcp";
    o["shm.mode"] = "staging";
  } else if (transport == "fabric") {
    o["engine.transports"] = "fabric,tcp";
  } else if (transport == "cuda_ipc") {
    // cuda_ipc carries the peer's GPU memory; tcp what it does not (the churn
    // process's host memory).
    o["engine.transports"] = "cuda_ipc,tcp";
  }
  o["engine.log_level"] = log_level;
  for (const std::string& kv : options) {
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) o[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return o;
}

std::string SoakConfig::ExpectedCarrier() const {
  if (transport == "tcp") return "tcp";
  if (transport == "shm-cma" || transport == "shm-staging") return "shm";
  if (transport == "fabric") return "fabric";
  if (transport == "cuda_ipc") return "cuda_ipc";
  return "";
}

std::string SoakConfig::Route() const {
  return memory == "gpu" ? "peer GPU memory" : "host memory";
}

namespace {
std::string Num(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}
}  // namespace

std::vector<std::string> SoakConfig::ToArgs() const {
  std::vector<std::string> a = {"--processes",
                                std::to_string(processes),
                                "--seconds",
                                Num(seconds),
                                "--transport",
                                transport,
                                "--max-bytes",
                                std::to_string(max_bytes),
                                "--max-iovs",
                                std::to_string(max_iovs),
                                "--slots",
                                std::to_string(slots),
                                "--threads",
                                std::to_string(threads),
                                "--read-share",
                                Num(read_share),
                                "--notify-share",
                                Num(notify_share),
                                "--cancel-share",
                                Num(cancel_share),
                                "--timeout-share",
                                Num(timeout_share),
                                "--region-every-ms",
                                Num(region_every_ms),
                                "--fail-bound-ms",
                                std::to_string(fail_bound_ms),
                                "--seed",
                                std::to_string(seed),
                                "--log-level",
                                log_level,
                                "--memory",
                                memory,
                                "--gpus",
                                std::to_string(gpus)};
  if (gpu_isolate) a.push_back("--gpu-isolate");
  for (const std::string& kv : options) {
    a.push_back("--option");
    a.push_back(kv);
  }
  return a;
}

void AddOptions(CLI::App& app, SoakConfig& c) {
  app.add_option("--processes,-n", c.processes, "engine processes, all-to-all")
      ->check(CLI::Range(2, 64));
  app.add_option("--seconds,-t", c.seconds, "seconds of traffic");
  app.add_option("--transport", c.transport,
                 "what carries the soak's memory (cuda_ipc: with --memory gpu only)")
      ->check(CLI::IsMember({"tcp", "shm-cma", "shm-staging", "fabric", "cuda_ipc", "auto"}));
  app.add_option("--memory", c.memory,
                 "every target area, readable region and local buffer is host memory or GPU "
                 "memory (cudaMalloc; worker i on GPU i % --gpus; checked through a host copy)")
      ->check(CLI::IsMember({"host", "gpu"}));
  app.add_option("--gpus", c.gpus,
                 "GPUs the workers spread over (default: every GPU the coordinator sees)");
  app.add_flag("--gpu-isolate", c.gpu_isolate,
               "each worker sees only its own GPU (CUDA_VISIBLE_DEVICES set per worker, as "
               "serving stacks launch theirs); without it every worker sees every GPU");
  app.add_option("--max-bytes", c.max_bytes,
                 "largest transfer in bytes (sizes are log-uniform from 1)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30));
  app.add_option("--max-iovs", c.max_iovs, "largest batch (log-uniform from 1)")
      ->check(CLI::Range(1u, 1000000u));
  app.add_option("--slots", c.slots, "slots each process owns in each peer's target area")
      ->check(CLI::Range(1, 64));
  app.add_option("--threads", c.threads, "threads posting transfers per process")
      ->check(CLI::Range(1, 64));
  app.add_option("--read-share", c.read_share, "share of reads")->check(CLI::Range(0.0, 1.0));
  app.add_option("--notify-share", c.notify_share, "share of writes with a notification")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--cancel-share", c.cancel_share, "share of transfers cancelled")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--timeout-share", c.timeout_share, "share of blocking calls that time out")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--region-every-ms", c.region_every_ms,
                 "each process registers a new readable region (and deregisters an old one) "
                 "this often; 0: never");
  app.add_option("--kill-every", c.kill_every,
                 "SIGKILL a random process (then restart it) every ~N s; 0: never");
  app.add_option("--stop-every", c.stop_every,
                 "SIGSTOP a random process for --stop-ms every ~N s; 0: never");
  app.add_option("--stop-min-ms", c.stop_min_ms, "shortest stop");
  app.add_option("--stop-max-ms", c.stop_max_ms, "longest stop");
  app.add_option("--fail-bound-ms", c.fail_bound_ms,
                 "a killed peer's in-flight transfers must fail within this");
  app.add_option("--churn", c.churn_cycles,
                 "engines a churn process creates, posts to and destroys with transfers in "
                 "flight (0: no churn process)");
  app.add_option("--report-every", c.report_every, "seconds between progress lines");
  app.add_option("--seed", c.seed, "random seed (0: random; printed)");
  app.add_option("--option,-o", c.options, "extra engine option name=value (repeatable)");
  app.add_option("--log-level", c.log_level, "engine.log_level of every engine");
}

}  // namespace ferry::soak
