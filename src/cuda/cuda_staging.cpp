#ifdef FAIRRING_WITH_CUDA

#include "cuda/cuda_staging.h"

#include <c10/util/Exception.h>

namespace fairring {

CudaStaging::CudaStaging(size_t numSlots, size_t hostSlotBytes, size_t deviceSlotBytes, c10::Device device)
    : numSlots_(numSlots), hostSlotBytes_(hostSlotBytes), deviceSlotBytes_(deviceSlotBytes) {
  const auto bytes = at::TensorOptions().dtype(at::kByte);
  // Pinned, so that copies to and from the GPU are asynchronous DMA.
  host_ = at::empty({static_cast<int64_t>(numSlots_ * hostSlotBytes_)}, bytes.pinned_memory(true));
  if (deviceSlotBytes_ > 0) {
    device_ = at::empty({static_cast<int64_t>(numSlots_ * deviceSlotBytes_)}, bytes.device(device));
  }
  for (size_t i = numSlots_; i > 0; --i) {
    free_.push_back(static_cast<int>(i - 1));
  }
}

int CudaStaging::tryAcquire() {
  if (free_.empty()) {
    return -1;
  }
  const int slot = free_.back();
  free_.pop_back();
  return slot;
}

void CudaStaging::release(int slot) {
  free_.push_back(slot);
}

at::Tensor CudaStaging::carve(
    const at::Tensor& pool,
    size_t slotBytes,
    int slot,
    at::ScalarType dtype,
    int64_t numel) {
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_INTERNAL_ASSERT(pool.defined() && bytes <= static_cast<int64_t>(slotBytes), "fairring: staging slot overflow");
  // Slots start at multiples of 64 bytes, so every dtype's view is aligned.
  return pool.narrow(0, static_cast<int64_t>(slot * slotBytes), bytes).view(dtype);
}

at::Tensor CudaStaging::host(int slot, at::ScalarType dtype, int64_t numel) const {
  return carve(host_, hostSlotBytes_, slot, dtype, numel);
}

at::Tensor CudaStaging::device(int slot, at::ScalarType dtype, int64_t numel) const {
  return carve(device_, deviceSlotBytes_, slot, dtype, numel);
}

} // namespace fairring

#endif // FAIRRING_WITH_CUDA
