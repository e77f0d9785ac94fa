#include "ops/tensor_fusion.h"

namespace fairring {

Fusion fuse(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    flat.push_back(t.reshape({-1}));
  }
  at::Tensor fused = at::cat(flat);
  std::function<void()> scatterBack = [tensors, fused]() mutable {
    int64_t offset = 0;
    for (auto& t : tensors) {
      t.copy_(fused.slice(0, offset, offset + t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  };
  return Fusion{fused, std::move(scatterBack)};
}

} // namespace fairring
