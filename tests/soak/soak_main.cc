// ferry-soak: N engine processes all-to-all for a set time over one
// transport, every byte verified, with faults (docs/reliability.md, "Soak").
// `ferry-soak --help` lists the options; the subcommands `worker` and `churn`
// are the processes the coordinator starts.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <climits>
#include <cstdio>
#include <random>

#include "soak_config.h"
#include "soak_coordinator.h"
#include "soak_memory.h"
#include "soak_worker.h"

int main(int argc, char** argv) {
  using namespace ferry::soak;
  SoakConfig config;
  CLI::App app{"ferry-soak: engine processes all-to-all, every byte verified, with faults"};
  AddOptions(app, config);
  int index = 0;
  uint32_t incarnation = 0;
  CLI::App* worker =
      app.add_subcommand("worker", "one engine process (started by the coordinator)");
  worker->add_option("--index", index)->required();
  worker->add_option("--incarnation", incarnation);
  CLI::App* churn = app.add_subcommand("churn", "the churn process (started by the coordinator)");
  CLI11_PARSE(app, argc, argv);
  if (worker->parsed()) return RunWorker(config, index, incarnation);
  if (churn->parsed()) return RunChurn(config);
  if (config.seed == 0) config.seed = std::random_device{}() | 1;
  if (config.transport == "cuda_ipc" && config.memory != "gpu") {
    std::fprintf(stderr, "ferry-soak: --transport cuda_ipc carries GPU memory: add --memory gpu\n");
    return 2;
  }
  if (config.memory == "gpu" && config.gpus <= 0) {
    std::string error;
    config.gpus = CountGpus(&error);
    if (config.gpus <= 0) {
      std::fprintf(stderr, "ferry-soak: --memory gpu: no GPU here (%s)\n",
                   config.gpus < 0 ? error.c_str() : "cudaGetDeviceCount answers 0");
      return 2;
    }
  }
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) {
    std::perror("ferry-soak: readlink /proc/self/exe");
    return 2;
  }
  self[n] = '\0';
  std::string options;
  for (const auto& [k, v] : config.EngineOptions()) options += " " + k + "=" + v;
  std::printf(
      "ferry-soak: %d processes, %s, %s memory%s, %.0f s, transfers of 1 B - %llu B in 1 - %u "
      "iovs, "
      "seed %llu, kill every %.0f s, stop every %.0f s, churn %d; engine options:%s\n",
      config.processes, config.transport.c_str(), config.memory.c_str(),
      config.memory != "gpu"
          ? ""
          : (" (worker i on GPU i % " + std::to_string(config.gpus) +
             (config.gpu_isolate ? ", each seeing only its own)" : ", each seeing all)"))
                .c_str(),
      config.seconds, static_cast<unsigned long long>(config.max_bytes), config.max_iovs,
      static_cast<unsigned long long>(config.seed), config.kill_every, config.stop_every,
      config.churn_cycles, options.c_str());
  std::fflush(stdout);
  return RunCoordinator(config, self);
}
