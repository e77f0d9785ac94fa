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
// A gather reader that is still reading (GroupFailure::kAbortGrace at most)
// is waited for as a failed send waits for it (PeerMesh::awaitDrained): on a
// busy host the abort may sit in its socket for longer than `wait`.
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

  // The peers whose close is held for longer than `wait`.
  std::vector<int> heldLongerThan(Clock::time_point now, std::chrono::milliseconds wait) const {
    std::vector<int> out;
    for (const auto& [peer, held] : held_) {
      if (now - held.at >= wait) {
        out.push_back(peer);
      }
    }
    return out;
  }

  // Held closes to act on now (peer, message): those older than `wait`, but
  // for a peer in `behind` (its gather reader has yet to reach what it was
  // sent, as one waiting for the CPU has) those older than `grace`.
  std::vector<std::pair<int, std::string>> expired(
      Clock::time_point now,
      std::chrono::milliseconds wait,
      std::chrono::milliseconds grace,
      const std::set<int>& behind) {
    std::vector<std::pair<int, std::string>> out;
    for (auto it = held_.begin(); it != held_.end();) {
      if (now - it->second.at < (behind.count(it->first) != 0 ? grace : wait)) {
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
