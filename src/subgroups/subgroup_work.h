#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <vector>

namespace fairring {

// The Work of a sub-group allreduce, with ProcessGroupNCCL's semantics: the
// operation is complete for the host once it is enqueued. wait() makes the
// caller's current stream wait for the done event and never blocks the host;
// isCompleted() asks whether the device has got there; the future is
// already completed, CUDA-aware (its value's readers synchronise with the
// done point through their streams), so `.then()` callbacks run at once on
// the calling thread — which is what lets DDP comm hooks issue their nested
// collectives in the same order on every rank. On a CPU device (the test
// path over Gloo sub-groups) there is no event: everything finished before
// the call returned.
class SubgroupWork : public c10d::Work {
 public:
  SubgroupWork(
      int rank,
      c10d::OpType opType,
      std::vector<at::Tensor> outputs,
      c10::intrusive_ptr<c10::ivalue::Future> future,
      std::shared_ptr<c10::Event> done,
      c10::Device device);

  bool isCompleted() override;
  bool isSuccess() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<c10::Event> done_;
  c10::Device device_;
};

} // namespace fairring
