#include "core/engine_options.h"

#include "core/gpu_path.h"
#include "transport/transport.h"

namespace ferry {
namespace {

const OptionSpec kEngineOptionSpecs[] = {
    {"engine.transports", OptionType::kString, "auto",
     "transports to run: auto (every one that can work here) or a comma list, e.g. tcp to force "
     "tcp, shm,tcp; per peer the fastest connected one that carries the memory is used"},
    {"engine.host_id", OptionType::kString, "",
     "identity of this host for the same-host decision (empty: the kernel's boot id); engines "
     "with different ids never use same-host transports between them"},
    {"engine.log_level", OptionType::kString, "warn",
     "log level: trace, debug, info, warn, error, off"},
    {"engine.wait_spin_us", OptionType::kUint, "100",
     "wait() on a small transfer (engine.wait_spin_max_bytes) spins this long before sleeping (0: "
     "sleep at once)",
     0, 100000},
    {"engine.wait_spin_max_bytes", OptionType::kBytes, "0",
     "wait() spins only on transfers of at most this many bytes; 0: the transport's choice (256 "
     "KiB where host cores copy; any size over cuda_ipc, whose copies run on the GPU)"},
    {"engine.test_yield", OptionType::kString, "auto",
     "test() of a running transfer larger than engine.wait_spin_max_bytes gives the calling "
     "thread's CPU up once (sched_yield) before it returns: a caller that polls in a loop "
     "(NIXL's check_xfer_state) leaves the core to the threads that copy the transfer. auto: on "
     "with fewer than 8 usable CPUs, where that loop and those threads share the cores"},
    {kGpuSameHostPathOption, OptionType::kString, "auto",
     "how GPU memory moves between engines of one host: auto (cuda_ipc where it connects, else "
     "staged through shm's shared host memory, never loopback tcp while shm is connected), or "
     "forced: cuda_ipc, shm_staged, tcp"},
    {"engine.merge_iovs", OptionType::kBool, "true",
     "iovs of one call that continue each other on both sides (the next local address and the "
     "next remote offset of the same descriptor) reach the transport as one segment"},
    // A slow or stalled peer: docs/reliability.md, "A slow peer".
    {kPeerWindowBytesOption, OptionType::kBytes, "4GiB",
     "payload bytes in flight to one peer (posted, not yet complete); a call that would pass it "
     "waits for room, then fails with Busy. A call larger than the window runs alone",
     1},
    {kPeerWindowIovsOption, OptionType::kUint, "262144",
     "segments (iovs after merging; a notification counts one) in flight to one peer; bounds "
     "the engine's bookkeeping per peer as peer_window_bytes bounds the payload",
     1},
    {kPeerWindowWaitOption, OptionType::kDurationMs, "10000",
     "how long write_async/read_async/notify wait for room in a full window before failing with "
     "Busy (0: fail at once); blocking write()/read() wait up to their own timeout instead",
     0, 86'400'000},
    {kNotificationQueueBytesOption, OptionType::kBytes, "256MiB",
     "notifications received and not yet taken (take_notifications / wait_notifications) may "
     "hold this much (payload plus 64 B each); past it new ones are dropped, counted "
     "(dropped_notifications) and named in a warning at most every 10 s",
     4096},
};

}  // namespace

std::vector<OptionSpec> all_option_specs() {
  std::vector<OptionSpec> specs(std::begin(kEngineOptionSpecs), std::end(kEngineOptionSpecs));
  for (const auto& t : registered_transports()) {
    specs.insert(specs.end(), t.options.begin(), t.options.end());
  }
  return specs;
}

}  // namespace ferry
