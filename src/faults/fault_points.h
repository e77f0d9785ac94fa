#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace fairring::faults {

// Test-only fault points: named places in the transport and the engine where a
// test makes this process wait, throw or close, so that an interleaving that
// load produces now and then happens every time (docs/design.md, "Fault
// points"). Only the test module (tests/native/) arms them; production code
// never does. While nothing is armed a point costs one relaxed atomic load and
// a branch that is always predicted right: that is all a production build pays.
enum class Action : uint8_t {
  kDelay, // sleep, then go on
  kThrow, // throw std::runtime_error (a reduction that fails)
  kClose, // the caller closes what it holds (a connection)
};

struct Fault {
  Action action{Action::kDelay};
  std::chrono::milliseconds delay{0};
};

namespace detail {
extern std::atomic<int> gArmed; // how many points are armed: 0 in production
std::optional<Fault> take(const char* point, int64_t key);
} // namespace detail

// What is armed at `point` for `key` (a peer's rank, an operation's turn; -1
// where the point has none), consuming one use; nullopt almost always.
inline std::optional<Fault> at(const char* point, int64_t key = -1) {
  if (detail::gArmed.load(std::memory_order_relaxed) == 0) {
    return std::nullopt;
  }
  return detail::take(point, key);
}

// at(), with delays slept and throws thrown here; true where armed to close.
bool hit(const char* point, int64_t key = -1);

// For the test module: arm `point` for `times` uses (matching `key`, or any
// key if -1), disarm everything, and count the uses so far.
void arm(const std::string& point, Action action, std::chrono::milliseconds delay, int times, int64_t key);
void disarmAll();
int uses(const std::string& point);

} // namespace fairring::faults
