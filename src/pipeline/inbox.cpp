#include "pipeline/inbox.h"

#include <algorithm>

namespace fairring {

void Inbox::park(Parked parked, const Locked&) {
  parked_[{parked.header.opSeq, parked.header.slice}].push_back(std::move(parked));
}

std::vector<Parked> Inbox::take(uint64_t seq, int64_t slice, const Locked&) {
  auto it = parked_.find({seq, slice});
  if (it == parked_.end()) {
    return {};
  }
  std::vector<Parked> waiting = std::move(it->second);
  parked_.erase(it);
  return waiting;
}

bool Inbox::holds(uint64_t seq, int64_t slice, int segment, int peer, Route route, const Locked&) const {
  auto it = parked_.find({seq, slice});
  return it != parked_.end() && std::any_of(it->second.begin(), it->second.end(), [&](const Parked& p) {
           return p.peer == peer && p.header.route == route && p.header.segment == segment;
         });
}

std::vector<Parked> Inbox::dropFrom(uint64_t fromSeq, const Locked&) {
  std::vector<Parked> unread;
  for (auto it = parked_.lower_bound({fromSeq, 0}); it != parked_.end();) {
    for (Parked& p : it->second) {
      if (!p.consumed) {
        unread.push_back(std::move(p));
      }
    }
    it = parked_.erase(it);
  }
  return unread;
}

} // namespace fairring
