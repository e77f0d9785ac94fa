#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace fairring::faults {

// Test-only: the seconds a timed trial call of the measured choice
// (src/measured/) is said to have taken, in place of what the clock or the
// device measured, so that a test decides on demand which way wins on each
// rank, and makes the ranks' own timings disagree. Only the test module
// (tests/native/) sets them; while none is set, asking costs one relaxed
// atomic load.
namespace detail {
extern std::atomic<int> gTrialClockSet; // entries set: 0 in production
std::optional<double> trialSeconds(const std::string& way, size_t fromBytes);
} // namespace detail

// What a timed call of `way` in the size class that starts at `fromBytes` is
// said to have taken, or nullopt: what was measured counts.
inline std::optional<double> trialSeconds(const std::string& way, size_t fromBytes) {
  if (detail::gTrialClockSet.load(std::memory_order_relaxed) == 0) {
    return std::nullopt;
  }
  return detail::trialSeconds(way, fromBytes);
}

// For the test module: every timed call of `way` in the class starting at
// `fromBytes` (any class: -1) takes `seconds`; clear() forgets them all.
void setTrialSeconds(const std::string& way, int64_t fromBytes, double seconds);
void clearTrialSeconds();

} // namespace fairring::faults
