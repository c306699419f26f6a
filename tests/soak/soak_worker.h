// One engine process of the soak: a target for every other process (an area
// of slots per source, a static readable region, readable regions registered
// and deregistered under traffic) and an initiator (threads posting writes and
// reads of random size and batch to every peer, some with notifications, some
// cancelled or timed out). It talks with the coordinator by lines on
// stdin/stdout (soak_coordinator.cc has the list).
//
// How every byte is checked. Source s owns `slots` slots in target t's area;
// only s writes them, one transfer per slot at a time, each a new generation
// whose content is the pattern of a seed derived from (s, t, slot,
// generation). After a write completes, the slot's content is known; a
// cancelled, timed-out or failed write leaves it unknown until the next
// completed write. s reads its slots back and compares with what it knows,
// so a frame of a cancelled write landing after a later write is a data
// error. A write with a notification is checked by the target when the
// notification arrives (delivered only once all its bytes are placed); the
// target then acknowledges it with a notification of its own, and s keeps
// the slot untouched until that acknowledgement: every notification must be
// seen exactly once (a second one is a duplicate, none within 30 s a loss).
#pragma once

#include "soak_config.h"

namespace ferry::soak {

// Runs worker `index`, incarnation `incarnation` (0 first, +1 per restart);
// returns the exit code.
int RunWorker(const SoakConfig& config, int index, uint32_t incarnation);

// Runs the churn process: engines created, connected, posted to and
// destroyed with transfers in flight, `config.churn_cycles` times.
int RunChurn(const SoakConfig& config);

// The content seeds every process derives the same way.
uint64_t StaticSeed(const SoakConfig& config, int index, uint32_t incarnation);

}  // namespace ferry::soak
