#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace fairring {

// A peer's reduce track read as closed before its gather track is held here
// until the gather track reaches its end too (an abort or the close), or until
// `wait` has passed. A peer that fails on purpose sends its reason on the
// gather track (always read) before it closes, but it may close without its
// reduce-track abort (GroupFailure: a rail writer held at another peer's
// parked reduce track does not hold the close): a reduce-track close read first
// does not mean that the peer died. The engine's lock guards it.
class PeerCloses {
 public:
  using Clock = std::chrono::steady_clock;

  bool gatherEnded(int peer) const {
    return gatherEnded_.count(peer) != 0;
  }

  void holdReduceClose(int peer, std::string message, Clock::time_point now) {
    held_.emplace(peer, Held{std::move(message), now});
  }

  // The gather track of `peer` ended: its held reduce-track close, to act on now.
  std::optional<std::string> endGather(int peer) {
    gatherEnded_.insert(peer);
    auto it = held_.find(peer);
    if (it == held_.end()) {
      return std::nullopt;
    }
    std::string message = std::move(it->second.message);
    held_.erase(it);
    return message;
  }

  // Held closes older than `wait`, to act on now (peer, message).
  std::vector<std::pair<int, std::string>> expired(Clock::time_point now, std::chrono::milliseconds wait) {
    std::vector<std::pair<int, std::string>> out;
    for (auto it = held_.begin(); it != held_.end();) {
      if (now - it->second.at < wait) {
        ++it;
        continue;
      }
      out.emplace_back(it->first, std::move(it->second.message));
      it = held_.erase(it);
    }
    return out;
  }

 private:
  struct Held {
    std::string message;
    Clock::time_point at;
  };
  std::map<int, Held> held_;
  std::set<int> gatherEnded_;
};

} // namespace fairring
