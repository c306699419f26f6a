// The coordinator: starts the engine processes (this executable's `worker`
// subcommand) and the churn process, tells each about the others, injects
// faults, gathers the reports, prints progress and the verdict.
//
// Lines to a worker: PEER index incarnation engine_id metadata area static
// (a peer, again after a restart); PREGION index incarnation gen seed length
// descriptor (a peer's newest readable region); FAULT kill|stop|cont index
// incarnation monotonic_ns; GO (start traffic); STOP (stop, drain, report);
// EXIT. From a worker: READY index incarnation engine_id metadata area
// static; REGION gen seed length descriptor; STATS key=value ...; ERROR text;
// DONE.
#pragma once

#include <string>

#include "soak_config.h"

namespace ferry::soak {

// Returns the exit code: 0 when no data error, no lost or duplicated
// notification, no crash and no error a fault does not explain was seen.
int RunCoordinator(const SoakConfig& config, const std::string& self);

}  // namespace ferry::soak
