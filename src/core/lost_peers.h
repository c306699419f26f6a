// What an engine keeps about peers whose connections were lost, so that a call
// naming one says why (PeerDisconnected with the reason) rather than "not
// connected". Anyone who reaches a listen port can complete a handshake under
// a new engine id, so it is bounded: past `max_kept` peers lost now, the
// oldest are forgotten. A peer that comes back and is lost again, over and
// over, leaves one entry, not one per loss.
//
// Not thread-safe: the engine calls it under its peers' mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "ferry/types.h"

namespace ferry {

class LostPeers {
 public:
  explicit LostPeers(size_t max_kept = 1024) : max_kept_(max_kept) {}

  // The peer is connected again: nothing is kept about it.
  void came_back(PeerId peer) { lost_.erase(peer); }
  // Records (or updates) why `peer` was lost; returns the peers forgotten to
  // stay within max_kept, oldest loss first.
  std::vector<PeerId> lost(PeerId peer, std::string why);
  // Why `peer` was lost; null when it is not (or no longer) kept.
  const std::string* why(PeerId peer) const;

  size_t kept() const { return lost_.size(); }
  // Entries of the loss order, stale ones included (bounded: tests).
  size_t order_entries() const { return order_.size(); }

 private:
  struct Lost {
    std::string why;
    uint64_t seq = 0;  // which entry of order_ stands for this loss
  };
  struct Entry {
    PeerId peer;
    uint64_t seq;
  };
  // The entry no longer stands for the peer's loss: the peer came back, or
  // came back and was lost again (a newer entry).
  bool stale(const Entry& e) const;

  size_t max_kept_;
  std::map<PeerId, Lost> lost_;
  std::deque<Entry> order_;  // the order peers were lost in (may hold stale entries)
  uint64_t seq_ = 0;
};

}  // namespace ferry
