#pragma once

#ifdef FAIRRING_WITH_CUDA

#include <ATen/ATen.h>

#include <cstddef>
#include <vector>

namespace fairring {

// The CUDA pipeline's staging: a fixed number of slots, each with a piece of
// pinned host memory (what crosses the network) and, with several local ranks,
// a piece of GPU memory (a padded slice). Allocated once, at the first CUDA
// allreduce, and never grown: when every slot is taken, slices wait (as on
// CPU). Not thread-safe: it lives under the engine's lock.
class CudaStaging {
 public:
  CudaStaging(size_t numSlots, size_t hostSlotBytes, size_t deviceSlotBytes, c10::Device device);

  size_t numSlots() const { return numSlots_; }
  // A slot index, or -1 if none is free.
  int tryAcquire();
  void release(int slot);

  // The first `numel` elements of a slot, viewed as `dtype`.
  at::Tensor host(int slot, at::ScalarType dtype, int64_t numel) const;
  at::Tensor device(int slot, at::ScalarType dtype, int64_t numel) const;

 private:
  static at::Tensor carve(const at::Tensor& pool, size_t slotBytes, int slot, at::ScalarType dtype, int64_t numel);

  size_t numSlots_;
  size_t hostSlotBytes_;
  size_t deviceSlotBytes_;
  at::Tensor host_;
  at::Tensor device_;
  std::vector<int> free_;
};

} // namespace fairring

#endif // FAIRRING_WITH_CUDA
