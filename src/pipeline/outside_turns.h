#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "pipeline/engine_lock.h"

namespace fairring {

// Calls that run outside the engine at their turn (on Gloo's ring), from
// watch() until done(): how to fail each if the group fails at or before its
// turn. Every method runs under the engine's lock; the fails it hands back
// run after it is released.
class OutsideTurns {
 public:
  using Fail = std::function<void(const std::string&)>;

  void watch(uint64_t seq, Fail fail, const Locked&) {
    fails_[seq] = std::move(fail);
  }
  void done(uint64_t seq, const Locked&) {
    fails_.erase(seq);
  }
  // Every call from turn `fromSeq` on, no longer watched: how to fail each.
  std::vector<Fail> takeFrom(uint64_t fromSeq, const Locked&) {
    std::vector<Fail> taken;
    for (auto it = fails_.lower_bound(fromSeq); it != fails_.end();) {
      taken.push_back(std::move(it->second));
      it = fails_.erase(it);
    }
    return taken;
  }

 private:
  std::map<uint64_t, Fail> fails_;
};

} // namespace fairring
