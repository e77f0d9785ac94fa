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

// How one allreduce of `numel` elements is cut: into slices of at most
// `sliceElems` elements; each slice into L chunks (one per local rank); each
// chunk into M shards (one per machine). Every rank computes the same plan
// from the same inputs, so no sizes need to travel on the wire.
class SlicePlan {
 public:
  SlicePlan(int64_t numel, int64_t sliceElems, int localSize, int numMachines)
      : numel_(numel),
        sliceElems_(std::max<int64_t>(1, sliceElems)),
        localSize_(localSize),
        numMachines_(numMachines) {}

  int64_t numel() const { return numel_; }
  int64_t numSlices() const { return (numel_ + sliceElems_ - 1) / sliceElems_; }

  Range slice(int64_t s) const {
    const int64_t begin = s * sliceElems_;
    return {begin, std::min(numel_, begin + sliceElems_)};
  }

  // Chunk `l` of slice `s`, in elements of the whole tensor. Balanced split:
  // sizes differ by at most one, so a slice smaller than L gives empty chunks.
  Range chunk(int64_t s, int l) const {
    return split(slice(s), l, localSize_);
  }

  // Shard `m` of chunk `l` of slice `s`.
  Range shard(int64_t s, int l, int m) const {
    return split(chunk(s, l), m, numMachines_);
  }

  // Upper bounds used to lay out a staging slot, valid for every slice.
  int64_t maxChunkElems() const { return (sliceElems_ + localSize_ - 1) / localSize_; }
  int64_t maxShardElems() const { return (maxChunkElems() + numMachines_ - 1) / numMachines_; }

 private:
  static Range split(Range r, int i, int n) {
    const int64_t len = r.size();
    return {r.begin + len * i / n, r.begin + len * (i + 1) / n};
  }

  int64_t numel_;
  int64_t sliceElems_;
  int localSize_;
  int numMachines_;
};

} // namespace fairring
