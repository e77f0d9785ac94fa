#pragma once

#include <algorithm>
#include <cstdint>

#include "pipeline/cuts.h"

namespace fairring {

// How one allreduce of `numel` elements is cut: into slices of at most
// `sliceElems` elements (a slice holds one staging slot); each slice into
// segments of L x `chunkElems` (the units the pipeline moves: segment g+1 is
// collected while segment g is reduced and diffused); each segment into L
// chunks (one per local rank); each chunk into M shards (one per machine).
// Every rank computes the same plan from the same inputs, so no sizes need to
// travel on the wire.
//
// Every segment but a slice's last has exactly `segmentElems()` elements, a
// multiple of L·M, so its chunks and shards are equal and a segment's pieces
// sit at fixed offsets of a staging slot sized for the whole slice (see
// chunkOffset and shardOffset): segments cost no staging memory of their own.
class SliceCuts {
 public:
  SliceCuts(int64_t numel, int64_t sliceElems, int64_t chunkElems, int localSize, int numMachines)
      : cuts_(numel,
              std::max<int64_t>(1, sliceElems),
              fitSegment(std::max<int64_t>(1, sliceElems), chunkElems, localSize, numMachines)),
        localSize_(localSize),
        numMachines_(numMachines) {}

  int64_t numel() const { return cuts_.total(); }
  int64_t numSlices() const { return cuts_.numSlices(); }
  int64_t segmentElems() const { return cuts_.segmentElems(); }
  Range slice(int64_t s) const { return cuts_.slice(s); }
  int numSegments(int64_t s) const { return cuts_.numSegments(s); }
  Range segment(int64_t s, int g) const { return cuts_.segment(s, g); }

  // Chunk `l` of segment `g` of slice `s`, in elements of the whole tensor.
  // Balanced split: sizes differ by at most one, so a segment smaller than L
  // gives empty chunks.
  Range chunk(int64_t s, int g, int l) const {
    return split(segment(s, g), l, localSize_);
  }

  // Shard `m` of chunk `l` of segment `g` of slice `s`.
  Range shard(int64_t s, int g, int l, int m) const {
    return split(chunk(s, g, l), m, numMachines_);
  }

  // Where segment g's chunk (shard) starts inside a staging region that holds
  // one chunk (shard) per segment of the slice, in elements.
  int64_t chunkOffset(int g) const { return g * (segmentElems() / localSize_); }
  int64_t shardOffset(int g) const { return g * (segmentElems() / (localSize_ * numMachines_)); }

  // Upper bounds used to lay out a staging slot, valid for every slice: the
  // chunks (shards) of all segments of a slice, end to end, never need more.
  int64_t maxChunkElems() const { return (cuts_.sliceElems() + localSize_ - 1) / localSize_; }
  int64_t maxShardElems() const { return (maxChunkElems() + numMachines_ - 1) / numMachines_; }

  // The staging one slice needs, laid out as the allreduce's steps use it:
  // the other L-1 local ranks' copies of its chunks, then the other M-1
  // machines' copies of its shards.
  int64_t stagedBytes(int64_t elemSize) const {
    return ((localSize_ - 1) * maxChunkElems() + (numMachines_ - 1) * maxShardElems()) * elemSize;
  }

 private:
  static Range split(Range r, int i, int n) {
    const int64_t len = r.size();
    return {r.begin + len * i / n, r.begin + len * (i + 1) / n};
  }

  // L chunks rounded down to a multiple of L·M (at least L·M); a slice that a
  // segment would not cut stays one segment. Segments let the collect of one
  // overlap the reduce and diffuse of the previous on a link between
  // machines: with one machine there is no such link and each segment only
  // adds messages, so the slice is one segment. The chunk is per local rank:
  // were the segment fixed, L ranks would each move 1/L of it, and the
  // per-message cost of the intra-machine steps would grow with L (2 x 2 on
  // loopback, 100 MiB: 87-92 ms with 1 MiB segments, 78-80 ms with 4 MiB).
  static int64_t fitSegment(int64_t sliceElems, int64_t chunkElems, int localSize, int numMachines) {
    if (numMachines == 1) {
      return sliceElems;
    }
    const int64_t unit = static_cast<int64_t>(localSize) * numMachines;
    const int64_t fitted = std::max(unit, chunkElems * localSize / unit * unit);
    return fitted >= sliceElems ? sliceElems : fitted;
  }

  Cuts cuts_;
  int localSize_;
  int numMachines_;
};

} // namespace fairring
