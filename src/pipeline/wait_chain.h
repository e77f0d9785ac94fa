#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace fairring {

// The wait chain's notes in the group's store (engine_blame.cpp says why).
// A rank writes one per operation that has waited half the timeout, under the
// operation's turn ("waits/<rank>/<turn>" = "<turn>:<ranks>") and as its
// latest ("waits/<rank>"). A rank that waits for peer P at turn t reads P's
// note for t: P may be waiting at a later turn too, for a rank that waits for
// P at t, and following that note goes round in a circle (chaos seed 123).
// The latest note stands in where P wrote none for t (a rank blocked in
// Gloo's collective notes the turn after its last).
struct WaitLink {
  int rank{-1};
  uint64_t seq{0};
  std::vector<int> ranks; // whom it waits for
};

// What the reading thread found, shared with the thread that asked, which may
// stop waiting for it (then the reader finishes alone, touching only this).
struct WaitChain {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<WaitLink> links; // each rank read, in order
  int silent{-1}; // the first rank with no note by the deadline
  bool done{false};
};

// Writes this rank's note for `seq` (and as its latest). Throws what the store throws.
void writeWaitNote(c10d::Store& store, int rank, uint64_t seq, const std::vector<int>& waited);

// Writes `me`'s note for `seq`, then follows the notes from `waited` (whom
// `me` waits for at `seq`) until a rank with none by `deadline`; fills
// `chain` and marks it done. Never throws: a failing store ends the chain.
void followWaitChain(
    c10::intrusive_ptr<c10d::Store> store,
    int me,
    uint64_t seq,
    std::vector<int> waited,
    int worldSize,
    std::chrono::steady_clock::time_point deadline,
    std::shared_ptr<WaitChain> chain);

} // namespace fairring
