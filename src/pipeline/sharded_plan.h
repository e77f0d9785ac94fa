#pragma once

#include <algorithm>
#include <cstdint>

#include "pipeline/slice_plan.h"

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
class ShardedPlan {
 public:
  ShardedPlan(int64_t partElems, int64_t sliceElems, int64_t segmentElems)
      : partElems_(partElems),
        sliceElems_(std::max<int64_t>(1, sliceElems)),
        segmentElems_(std::clamp<int64_t>(segmentElems, 1, sliceElems_)) {}

  int64_t partElems() const { return partElems_; }
  int64_t sliceElems() const { return sliceElems_; }
  int64_t numSlices() const { return (partElems_ + sliceElems_ - 1) / sliceElems_; }

  Range slice(int64_t s) const {
    const int64_t begin = s * sliceElems_;
    return {std::min(partElems_, begin), std::min(partElems_, begin + sliceElems_)};
  }

  // At least one, so that an empty slice still exchanges (empty) messages.
  int numSegments(int64_t s) const {
    return static_cast<int>(std::max<int64_t>(1, (slice(s).size() + segmentElems_ - 1) / segmentElems_));
  }

  Range segment(int64_t s, int g) const {
    const Range sl = slice(s);
    const int64_t begin = sl.begin + g * segmentElems_;
    return {std::min(sl.end, begin), std::min(sl.end, begin + segmentElems_)};
  }

  // Where segment g of slice s starts inside a staging piece that holds one
  // slice's range, in elements.
  int64_t offsetInSlice(int64_t s, int g) const { return segment(s, g).begin - slice(s).begin; }

  // Rank r's part of `range`, in elements of the big tensor.
  Range ofRank(int r, Range range) const {
    return {r * partElems_ + range.begin, r * partElems_ + range.end};
  }

 private:
  int64_t partElems_;
  int64_t sliceElems_;
  int64_t segmentElems_;
};

} // namespace fairring
