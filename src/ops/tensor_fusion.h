#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace fairring {

// Tensor Fusion (as Horovod calls it): coalesced tensors are reduced as one
// flat buffer, cut into slices like any other allreduce, then copied back.
struct Fusion {
  at::Tensor fused;
  // Copies the reduced buffer back into the tensors, each in its own shape.
  std::function<void()> scatterBack;
};

// `tensors` must already be checked to share dtype and device.
Fusion fuse(const std::vector<at::Tensor>& tensors);

} // namespace fairring
