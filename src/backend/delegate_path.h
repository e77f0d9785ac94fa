#pragma once

#include <atomic>
#include <string>

#include "device/device_path.h"

namespace fairring {

// A device whose every collective is its delegate's own, returned as the
// delegate made it: CUDA where the plan composes no call (NCCL's allreduce,
// CUDA graph capture, every dtype and op NCCL takes, no stream or event of
// fairring's), or where ranks share a GPU (Gloo). Without a delegate (a rank
// without a GPU), every collective raises `unavailable`.
class DelegatePath : public DevicePath {
 public:
  DelegatePath(c10::intrusive_ptr<c10d::Backend> delegate, int rank, std::string unavailable)
      : delegate_(std::move(delegate)), rank_(rank), unavailable_(std::move(unavailable)) {}

  c10::intrusive_ptr<c10d::Work> delegated(
      const std::vector<at::Tensor>& tensors,
      const Issue& issue,
      Callers callers,
      const std::optional<Announced>& what) override;
  void awaitIssued(const c10d::BarrierOptions& opts) override;

 private:
  const c10::intrusive_ptr<c10d::Backend> delegate_;
  DelegateBarrier barrier_;
  const int rank_;
  const std::string unavailable_;
};

} // namespace fairring
