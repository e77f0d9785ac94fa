#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>

namespace fairring {

// The group's collectives handed to its delegate (Gloo) that have not ended,
// so that a rank blocked in one can say so when a timeout follows the wait
// chain (engine_blame.cpp): such a rank waits for the others, not for the
// engine. Shared with the delegate's callbacks, which may outlive the engine.
class DelegatedCalls {
 public:
  using Clock = std::chrono::steady_clock;

  uint64_t begin() {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_++;
    inFlight_.emplace(id, Call{Clock::now(), false});
    return id;
  }

  void end(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    inFlight_.erase(id);
  }

  // The oldest call begun before `before` and not yet noted, marked noted now.
  std::optional<uint64_t> takeOldBefore(Clock::time_point before) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, call] : inFlight_) {
      if (call.began > before) {
        return std::nullopt;
      }
      if (!call.noted) {
        call.noted = true;
        return id;
      }
    }
    return std::nullopt;
  }

 private:
  struct Call {
    Clock::time_point began;
    bool noted;
  };
  std::mutex mu_;
  uint64_t next_{0};
  std::map<uint64_t, Call> inFlight_;
};

} // namespace fairring
