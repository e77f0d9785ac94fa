#pragma once

#include <algorithm>
#include <cstdint>

#include "pipeline/cuts.h"

namespace fairring {

// How a reduce-scatter or all-gather of `partElems` elements per rank is cut.
// The big tensor (the reduce-scatter's input, the all-gather's output) holds
// W parts of `partElems`, rank r's at r·partElems. Slices and segments are
// ranges of one part, [0, partElems); every rank's part is cut the same way,
// so slice s of the operation is the same range of all W parts.
//
// A reduce-scatter slice of k elements per part stages (L-1)·M pieces of k
// (the machine's other local ranks' copies of the parts of this rank's rail)
// and M-1 pieces of k (the other machines' partial sums of this rank's part):
// for k = sliceElems / W that is what an allreduce slice of sliceElems stages,
// so one staging slot fits either.
class ShardedCuts {
 public:
  ShardedCuts(int64_t partElems, int64_t sliceElems, int64_t segmentElems)
      : cuts_(partElems, sliceElems, segmentElems) {}

  int64_t partElems() const { return cuts_.total(); }
  int64_t sliceElems() const { return cuts_.sliceElems(); }
  int64_t numSlices() const { return cuts_.numSlices(); }
  Range slice(int64_t s) const { return cuts_.slice(s); }
  int numSegments(int64_t s) const { return cuts_.numSegments(s); }
  Range segment(int64_t s, int g) const { return cuts_.segment(s, g); }

  // Where segment g of slice s starts inside a staging piece that holds one
  // slice's range, in elements.
  int64_t offsetInSlice(int64_t s, int g) const { return segment(s, g).begin - slice(s).begin; }

  // Rank r's part of `range`, in elements of the big tensor.
  Range ofRank(int r, Range range) const {
    return {r * partElems() + range.begin, r * partElems() + range.end};
  }

 private:
  Cuts cuts_;
};

} // namespace fairring
