#pragma once

#include <cstdint>
#include <vector>

#include "common/held.h"
#include "device/done_point.h"
#include "subgroups/call_cut.h"
#include "subgroups/in_flight_ops.h"

namespace fairring {

// What the path counts, for tests and benchmarks to read (which path each
// allreduce took, whether ordering made it wait).
struct CallCounts {
  uint64_t operations{0}; // allreduces and coalesced allreduces, whichever way they went
  uint64_t ncclCalls{0}; // those handed to the delegate's own allreduce, returned as it made them
  uint64_t composedCalls{0}; // those cut into pieces
  uint64_t directUnits{0}; // tails of composed calls: one allreduce on the world group each
  uint64_t slicedUnits{0}; // pieces that went through the composition
  std::vector<uint64_t> rows; // operations per row of the plan
  // Earlier operations, still in flight on bytes a later one touches, that it
  // was made to wait for (an allreduce's streams, or the caller's stream
  // before a collective handed to the delegate).
  uint64_t orderingWaits{0};
  // Collectives handed to the delegate under CUDA graph capture on bytes of
  // an allreduce that may still be in flight: not ordered after it (events
  // from outside a capture cannot be waited for inside it).
  uint64_t unorderedInCapture{0};
};

// The composed path's record of its calls, guarded by the allreduce's lock
// (every method takes the Held it makes): each composed call's turn (the one
// GroupFailure fails from), the lane each unit takes (units take lanes in
// turn, so alike on every rank), the operations the device may still run with
// the bytes they touch (what a later call on those bytes waits for), and the
// counts.
class CallLedger {
 public:
  CallLedger(size_t planRows, int numLanes);

  // The turn the next composed call takes, and taking it.
  uint64_t nextTurn(const Held&) const {
    return turns_;
  }
  uint64_t takeTurn(const Held&) {
    return turns_++;
  }
  // The lane the next unit takes, and taking it.
  int nextLane(const Held&) const {
    return static_cast<int>(units_ % numLanes_);
  }
  int takeLane(const Held&) {
    return static_cast<int>(units_++ % numLanes_);
  }

  InFlightOps<Done>& inFlight(const Held&) {
    return inFlight_;
  }

  // A call of plan row `row` handed to the delegate's own allreduce.
  void countDelegated(const Held&, size_t row);
  // A call on the path's streams, after `orderingWaits` earlier operations.
  void countCall(const Held&, const CallCut& cut, size_t orderingWaits);
  void countUnits(const Held&, uint64_t direct, uint64_t sliced);
  void countOrderingWait(const Held&) {
    ++counts_.orderingWaits;
  }
  void countUnorderedInCapture(const Held&) {
    ++counts_.unorderedInCapture;
  }
  const CallCounts& counts(const Held&) const {
    return counts_;
  }

 private:
  void countRow(size_t row);

  const size_t planRows_;
  const int numLanes_;
  uint64_t turns_{0}; // composed calls so far
  uint64_t units_{0}; // units issued so far
  InFlightOps<Done> inFlight_;
  CallCounts counts_;
};

} // namespace fairring
