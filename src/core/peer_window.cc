#include "core/peer_window.h"

#include <algorithm>

#include "fmt/format.h"

namespace ferry {

bool PeerWindows::fits(const Usage& used, uint64_t bytes, uint64_t iovs) const {
  if (used.transfers == 0) return true;
  return bytes <= limits_.bytes - std::min(used.bytes, limits_.bytes) &&
         iovs <= limits_.iovs - std::min(used.iovs, limits_.iovs);
}

Status PeerWindows::acquire(PeerId peer, uint64_t bytes, uint64_t iovs,
                            Clock::time_point deadline) {
  std::unique_lock lock(mu_);
  PeerState& st = peers_[peer];
  if (!fits(st.used, bytes, iovs)) {
    const auto start = Clock::now();
    ++st.waiters;
    const bool room =
        st.room.wait_until(lock, deadline, [&] { return fits(st.used, bytes, iovs); });
    --st.waiters;
    if (!room) {
      const Usage u = st.used;
      if (u.transfers == 0 && st.waiters == 0) peers_.erase(peer);
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
      return err::Busy(fmt::format(
          "peer {:016x}: its window is full: {} transfers in flight ({} bytes, {} iovs; bound "
          "engine.peer_window_bytes={}, engine.peer_window_iovs={}); a call of {} bytes in {} "
          "iovs found no room in {} ms (the peer drains slowly or has stopped; retry later)",
          peer, u.transfers, u.bytes, u.iovs, limits_.bytes, limits_.iovs, bytes, iovs, waited));
    }
  }
  st.used.bytes += bytes;
  st.used.iovs += iovs;
  ++st.used.transfers;
  return Status::Ok();
}

void PeerWindows::release(PeerId peer, uint64_t bytes, uint64_t iovs) {
  std::lock_guard lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return;
  PeerState& st = it->second;
  st.used.bytes -= std::min(st.used.bytes, bytes);
  st.used.iovs -= std::min(st.used.iovs, iovs);
  if (st.used.transfers > 0) --st.used.transfers;
  if (st.waiters > 0) {
    // Under mu_: a waiter that times out may erase the entry once it has it.
    st.room.notify_all();
  } else if (st.used.transfers == 0) {
    peers_.erase(it);
  }
}

PeerWindows::Usage PeerWindows::usage(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = peers_.find(peer);
  return it == peers_.end() ? Usage{} : it->second.used;
}

}  // namespace ferry
