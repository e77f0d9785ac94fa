#pragma once

#include <cstdint>

namespace fairring {

// The calls of one size class under the measured choice (docs/design.md, "The
// measured choice"), by their number in the class alone, so that every rank
// runs each call the same way: never by timing, which differs between ranks.
//
//   calls 0, 1    way 0, way 1: not timed (each way connects then)
//   calls 2..9    A B B A A B B A: timed, kTimedCalls each; the ABBA order
//                 gives each way the same share of a drifting load and of a
//                 program that alternates two sizes in one class
//   call 10       the decision (kDecisionCall): every rank waits for its own
//                 timings, the ranks agree on the slowest rank's, and this
//                 call and every later one run the faster way
//
// So a class costs kDecisionCall calls of trials, at most kDecisionCall / 2 of
// them on the slower way.
constexpr int kWarmupCalls = 1; // per way
constexpr int kTimedCalls = 4; // per way
constexpr int64_t kDecisionCall = 2 * (kWarmupCalls + kTimedCalls);

struct TrialCall {
  int way{0}; // 0 or 1
  bool timed{false};
};

// The way and timing of trial call `call` (0 <= call < kDecisionCall).
constexpr TrialCall trialCall(int64_t call) {
  if (call < 2 * kWarmupCalls) {
    return TrialCall{static_cast<int>(call % 2), false};
  }
  const int64_t k = (call - 2 * kWarmupCalls) % 4;
  return TrialCall{k == 1 || k == 2 ? 1 : 0, true};
}

} // namespace fairring
