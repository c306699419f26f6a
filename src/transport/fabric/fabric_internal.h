// Pieces the fabric transport's files share: constants of the progress and
// posting paths, small helpers and the peer address blob.
#pragma once

#include <rdma/fabric.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "fmt/format.h"
#include "transport/fabric/fabric_transport.h"

namespace ferry::fabric::internal {

using Clock = std::chrono::steady_clock;
inline constexpr size_t kRecvBuffers = 16;
inline constexpr size_t kCqBatch = 64;
// How long a waiter's last poll of the CQ keeps the progress thread off it,
// unless the waiter says it stopped (stop_polling) -- a waiter that returned
// with its transfer done usually comes back soon with the next one.
inline constexpr int64_t kWaiterLeaseNs = 200000;
// While a waiter keeps renewing its lease, the progress thread's naps grow
// from kWaiterLeaseNs to this (each wake-up to look costs a context switch,
// on 2 cores a preempted thread: 3,400 a second at 200 us). So a waiter that
// leaves without stop_polling() -- its transfer done, nothing else waited on
// -- gives the CQ back within this at worst.
inline constexpr int64_t kMaxWaiterNapNs = 1000000;
// Core's wait() polls (spins) only on transfers of at most this many bytes
// (kSpinMaxBytes in core/engine.cc): a larger one posted while a waiter holds
// the lease brings the progress thread back at once.
inline constexpr uint64_t kPolledMaxBytes = 256 << 10;
// The longest the progress thread polls after its last event (it grows from
// fabric.poll_spin_us while wake-ups follow each other closely).
inline constexpr std::chrono::microseconds kMaxPollSpin{2000};
inline constexpr uint32_t kApiVersion = FI_VERSION(1, 9);
// FI_HMEM with a CUDA device in fi_mr_attr (fi_mr_regattr).
inline constexpr uint32_t kHmemApiVersion = FI_VERSION(1, 10);
// One staging slot: a GPU piece of a transfer, the most one RMA op of it moves.
inline constexpr uint64_t kStagingSlotBytes = 1 << 20;
// Address blob flags.
inline constexpr uint16_t kAddressHmem = 1;  // the engine registers GPU memory with FI_HMEM

inline std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

inline GrantKey key_of(const RemoteAccessRequest& r) {
  return {r.region_id, r.adv_offset, r.adv_length, r.key, r.access};
}

// Errors a provider reports when the connection to the peer is gone.
bool is_disconnect(int err);

// Format 2 adds the flags (format 1, without them, is still read).
struct AddressBlob {
  std::string provider, fabric, domain;
  Bytes name;
  uint16_t flags = 0;
};

Bytes encode_address(const AddressBlob& a);
Result<AddressBlob> decode_address(ByteView b);

}  // namespace ferry::fabric::internal
