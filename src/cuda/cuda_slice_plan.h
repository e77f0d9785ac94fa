#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace fairring {

// How a CUDA allreduce of `numel` elements is cut. Unlike the CPU SlicePlan's
// balanced split, chunks here are equal: NCCL's reduce-scatter and all-gather
// take equal pieces, in place, at offset l*c of the slice. Slices hold a
// multiple of L elements, so only a tensor's last slice can need padding to
// L*c; that slice goes through a staging buffer on the GPU.
class CudaSlicePlan {
 public:
  CudaSlicePlan(int64_t numel, size_t sliceBytes, size_t elemSize, int localSize)
      : numel_(numel), localSize_(localSize) {
    const int64_t perSlice = static_cast<int64_t>(sliceBytes / elemSize);
    sliceElems_ = std::max<int64_t>(localSize, perSlice / localSize * localSize);
  }

  int64_t numSlices() const { return (numel_ + sliceElems_ - 1) / sliceElems_; }
  int64_t begin(int64_t s) const { return s * sliceElems_; }
  int64_t size(int64_t s) const { return std::min(numel_, begin(s) + sliceElems_) - begin(s); }
  // Elements per chunk of slice s; the slice is padded to localSize * chunk.
  int64_t chunk(int64_t s) const { return (size(s) + localSize_ - 1) / localSize_; }
  bool padded(int64_t s) const { return chunk(s) * localSize_ != size(s); }
  int64_t maxChunkElems() const { return sliceElems_ / localSize_; }

 private:
  int64_t numel_;
  int localSize_;
  int64_t sliceElems_{1};
};

// Bytes of one CUDA staging slot: on the host (pinned), the chunk that crosses
// the network; on the GPU (only with several local ranks), a padded slice.
inline size_t cudaHostSlotBytes(size_t sliceBytes, int localSize) {
  const size_t chunk = std::max<size_t>(8, (sliceBytes + localSize - 1) / localSize);
  return (chunk + 63) / 64 * 64;
}

inline size_t cudaDeviceSlotBytes(size_t sliceBytes, int localSize) {
  if (localSize == 1) {
    return 0; // one rank per machine never pads: the chunk is the slice
  }
  return std::max<size_t>(sliceBytes, 8 * static_cast<size_t>(localSize) + 64) / 64 * 64 + 64;
}

} // namespace fairring
