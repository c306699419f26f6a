// What one soak run does: the options the coordinator takes on its command
// line and hands to every process it starts (workers, the churn process).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace ferry::soak {

struct SoakConfig {
  int processes = 4;                 // engine processes, all-to-all
  double seconds = 60;               // traffic time (faults stop, then a drain)
  std::string transport = "tcp";     // tcp, shm-cma, shm-staging, fabric, cuda_ipc, auto
  std::string memory = "host";       // what every area, region and buffer is: host, gpu
  int gpus = 0;                      // GPUs the workers spread over (the coordinator counts)
  bool gpu_isolate = false;          // each worker sees only its GPU (CUDA_VISIBLE_DEVICES)
  uint64_t max_bytes = 16ull << 20;  // largest transfer (sum of its iovs)
  uint32_t max_iovs = 4096;          // largest batch
  int slots = 3;                     // slots each source owns in each target's area
  int threads = 3;                   // threads posting transfers, per process
  double read_share = 0.45;          // of transfers, reads (the rest writes)
  double notify_share = 0.25;        // of writes, with a notification
  double cancel_share = 0.1;         // of cancellable transfers, cancel() after 0-3 ms
  double timeout_share = 0.1;        // of cancellable transfers, a blocking call timing out
  double region_every_ms = 200;      // each process registers a new readable region this often
  // Faults (0: off): mean seconds between them.
  double kill_every = 0;
  double stop_every = 0;
  uint32_t stop_min_ms = 1000, stop_max_ms = 4000;
  uint32_t fail_bound_ms = 2000;  // a killed peer's transfers fail within this
  int churn_cycles = 0;           // engines created, posted to, destroyed in flight
  double report_every = 5;
  uint64_t seed = 0;                 // 0: random
  std::vector<std::string> options;  // extra engine options, "name=value"
  std::string log_level = "error";   // engine.log_level of every engine

  // Engine options for `transport` plus `options`.
  std::map<std::string, std::string> EngineOptions() const;
  // The transport peer_transports() must name for the soak's memory ("" for auto).
  std::string ExpectedCarrier() const;
  // The route the soak's transfers take: "host memory", or "peer GPU memory"
  // (every remote side is GPU memory) with --memory gpu.
  std::string Route() const;
  // argv tail that gives a child process the same configuration.
  std::vector<std::string> ToArgs() const;
};

// Registers the options on `app` (the coordinator and the child subcommands).
void AddOptions(CLI::App& app, SoakConfig& config);

}  // namespace ferry::soak
