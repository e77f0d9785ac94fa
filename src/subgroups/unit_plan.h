#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fairring {

// One piece of an allreduce as the sub-group path issues it: a range of the
// flattened tensor that either goes through the five steps (a "slice", whose
// length splits evenly into L chunks of M shards) or is reduced by one
// allreduce on the world group ("direct").
struct Unit {
  int64_t begin{0};
  int64_t size{0};
  bool direct{false};
};

// How an allreduce of `numel` elements of `elemSize` bytes is cut. Every rank
// computes the same units from the same inputs, so they issue the same
// collectives. Slices are whole multiples of L*M elements so that they are
// reduce-scattered and gathered in place in the caller's tensor; the few
// elements left over (fewer than L*M) are one direct unit, which needs no
// padding and no staging. Without `slices` (the group has no lanes: one
// machine, or FAIRRING_CUDA_ALLREDUCE chose NCCL's allreduce), or for a
// tensor smaller than `directBelowBytes`, it is a single direct allreduce:
// there is no rail to shard across, the five steps would save no bytes, or
// their latency outweighs what they save.
inline std::vector<Unit> planUnits(
    int64_t numel,
    size_t elemSize,
    size_t sliceBytes,
    int localSize,
    int numMachines,
    size_t directBelowBytes,
    bool slices) {
  std::vector<Unit> units;
  if (numel == 0 || localSize * numMachines == 1) {
    return units;
  }
  const int64_t unit = static_cast<int64_t>(localSize) * numMachines;
  const bool small = static_cast<size_t>(numel) * elemSize < directBelowBytes;
  if (!slices || numMachines == 1 || small || numel < unit) {
    units.push_back(Unit{0, numel, true});
    return units;
  }
  // sliceBytes is a multiple of 8*L*M (fairring_pg.config), so a slice of any
  // dtype of up to 8 bytes is a whole number of L*M-element groups.
  const int64_t sliceElems = static_cast<int64_t>(sliceBytes / elemSize);
  const int64_t aligned = numel - numel % unit;
  for (int64_t begin = 0; begin < aligned; begin += sliceElems) {
    units.push_back(Unit{begin, std::min(sliceElems, aligned - begin), false});
  }
  if (aligned < numel) {
    units.push_back(Unit{aligned, numel - aligned, true});
  }
  return units;
}

// Bytes of the staging one lane needs for slices of `sliceBytes`: my chunk
// after the reduce-scatter (only with several local ranks), the M shards the
// collect brings, and my reduced shard. Each region starts 256-byte aligned.
inline size_t laneStagingBytes(size_t sliceBytes, int localSize, int numMachines) {
  auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t chunk = sliceBytes / static_cast<size_t>(localSize);
  const size_t shard = chunk / static_cast<size_t>(numMachines);
  return (localSize > 1 ? aligned(chunk) : 0) + aligned(chunk) + aligned(shard);
}

} // namespace fairring
