// GPU memory through a connection's staging areas: the copies between GPU
// memory and shared host memory that the initiator (into its area for a
// write, out of it after a read) and the target (between the peer's area and
// its GPU region) make, each with the copy engine of the GPU concerned.
//
// The area is pinned with the CUDA runtime (cudaHostRegisterPortable) in the
// process that copies, on its first GPU copy, so both copies run on the copy
// engine from pinned memory: two back-to-back copy-engine copies in all. An
// area the runtime refuses to pin is still used, from pageable memory.
#pragma once

#include <span>

#include "transport/shm/shm_transport.h"

namespace ferry::shm {

// Copies `pieces` between local memory (piece.local) and the area
// (own: ours, else the peer's; piece.remote an offset in it). `to_area`:
// local → area, else area → local. devices[i] >= 0: piece i's local side is
// GPU memory of that device (a copy-engine copy, waited for before this
// returns); -1 or `devices` empty: host memory (memcpy). `after`: the GPU
// copies run after the caller's default-stream work it marks (taken when
// the transfer was posted).
Status copy_through_area(Connection& c, bool own, std::span<const CopyPiece> pieces,
                         std::span<const int> devices, bool to_area,
                         const DefaultStreamMark* after = nullptr);

}  // namespace ferry::shm
