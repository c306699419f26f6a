#include "core/lost_peers.h"

#include <algorithm>
#include <utility>

namespace ferry {

std::vector<PeerId> LostPeers::lost(PeerId peer, std::string why) {
  auto [it, inserted] = lost_.try_emplace(peer);
  it->second.why = std::move(why);
  if (inserted) {
    it->second.seq = ++seq_;
    order_.push_back({peer, it->second.seq});
  }
  std::vector<PeerId> forgotten;
  while (lost_.size() > max_kept_ && !order_.empty()) {
    const Entry oldest = order_.front();
    order_.pop_front();
    if (stale(oldest)) continue;
    lost_.erase(oldest.peer);
    forgotten.push_back(oldest.peer);
  }
  // Peers that came back left their entries behind, and one lost again has a
  // newer entry besides: drop the stale ones now and then, so that only
  // entries of peers lost now remain.
  if (order_.size() > 2 * max_kept_) {
    std::erase_if(order_, [this](const Entry& e) { return stale(e); });
  }
  return forgotten;
}

const std::string* LostPeers::why(PeerId peer) const {
  auto it = lost_.find(peer);
  return it == lost_.end() ? nullptr : &it->second.why;
}

bool LostPeers::stale(const Entry& e) const {
  auto it = lost_.find(e.peer);
  return it == lost_.end() || it->second.seq != e.seq;
}

}  // namespace ferry
