#pragma once

#include <algorithm>
#include <cstdint>

namespace fairring {

// A half-open range of elements [begin, end) of the flattened tensor.
struct Range {
  int64_t begin{0};
  int64_t end{0};
  int64_t size() const { return end - begin; }
};

// How `total` elements are cut into slices of at most `sliceElems` (a slice
// holds one staging slot) and each slice into segments of at most
// `segmentElems` (the units the pipeline moves). Both plans cut this way:
// SliceCuts the allreduce's tensor, ShardedCuts one rank's part.
class Cuts {
 public:
  Cuts(int64_t total, int64_t sliceElems, int64_t segmentElems)
      : total_(total),
        sliceElems_(std::max<int64_t>(1, sliceElems)),
        segmentElems_(std::clamp<int64_t>(segmentElems, 1, sliceElems_)) {}

  int64_t total() const { return total_; }
  int64_t sliceElems() const { return sliceElems_; }
  int64_t segmentElems() const { return segmentElems_; }
  int64_t numSlices() const { return (total_ + sliceElems_ - 1) / sliceElems_; }

  Range slice(int64_t s) const {
    const int64_t begin = s * sliceElems_;
    return {std::min(total_, begin), std::min(total_, begin + sliceElems_)};
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

 private:
  int64_t total_;
  int64_t sliceElems_;
  int64_t segmentElems_;
};

} // namespace fairring
