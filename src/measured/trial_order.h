#pragma once

#include <cstdint>

namespace fairring {

// The calls of one size class under the measured choice (docs/design.md, "The
// measured choice"), by their number in the class alone, so that every rank
// runs each call the same way: never by timing, which differs between ranks.
//
//   calls 0..11   four blocks of three calls, ways A B B A: in each block the
//                 first call is not timed (it absorbs the switch from the other
//                 way: connections made on the way's first call, a link's
//                 queues and buffers left by the other way), the other two are;
//                 the ABBA order gives each way the same share of a drifting load
//   call 12       the decision (kDecisionCall): every rank waits for its own
//                 timings, the ranks agree on the slowest rank's, and this call
//                 and every later one run the faster way
//
// So a class costs kDecisionCall calls of trials, kDecisionCall / 2 of them on
// the slower way, kTimedCalls of each way timed.
constexpr int kBlockCalls = 3; // per block: one untimed, then timed
constexpr int kBlocks = 4; // A B B A
constexpr int kTimedCalls = kBlocks / 2 * (kBlockCalls - 1); // per way: 4
constexpr int64_t kDecisionCall = kBlocks * kBlockCalls; // 12

struct TrialCall {
  int way{0}; // 0 or 1
  bool timed{false};
};

// The way and timing of trial call `call` (0 <= call < kDecisionCall).
constexpr TrialCall trialCall(int64_t call) {
  const int64_t block = (call / kBlockCalls) % kBlocks;
  return TrialCall{block == 1 || block == 2 ? 1 : 0, call % kBlockCalls != 0};
}

} // namespace fairring
