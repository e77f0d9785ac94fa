#include "pipeline/send_order.h"

namespace fairring {

void SendOrder::expect(uint64_t seq, int key, int64_t count) {
  if (count > 0) {
    open_[key][seq] += count;
  }
}

bool SendOrder::queued(uint64_t seq, int key) {
  auto dest = open_.find(key);
  if (dest == open_.end()) {
    return false;
  }
  auto it = dest->second.find(seq);
  if (it == dest->second.end()) {
    return false;
  }
  if (--it->second == 0) {
    dest->second.erase(it);
  }
  return true;
}

bool SendOrder::mayLeave(uint64_t seq, int key) const {
  auto dest = open_.find(key);
  return dest == open_.end() || dest->second.empty() || dest->second.begin()->first >= seq;
}

void SendOrder::dropFrom(uint64_t seq) {
  for (auto& [key, ops] : open_) {
    ops.erase(ops.lower_bound(seq), ops.end());
  }
}

bool SendOrder::expecting(uint64_t seq) const {
  for (const auto& [key, ops] : open_) {
    if (ops.count(seq)) {
      return true;
    }
  }
  return false;
}

} // namespace fairring
