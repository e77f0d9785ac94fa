#pragma once

#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <string>

// ProcessGroupGloo with the vehicle's tensors, as it is with CUDA tensors
// (FAIRRING_TEST_LOCAL_GLOO makes the local groups of a composed allreduce
// Gloo's, so that several ranks of a simulated machine share one GPU). What
// it copies from torch's ProcessGroupGloo.cpp and gloo/ProcessGroupGlooCuda.cpp
// (AsyncAllreduceCUDAHostWork; _reduce_scatter_base's LambdaWork):
//  - at issue, a stream of the group's own waits for the caller's current
//    stream and copies the inputs to the host; Gloo reduces there;
//  - allreduce and _allgather_base copy the result back in run(), on that
//    stream, with an event: synchronize() (and wait()) make the caller's
//    current stream wait for it;
//  - _reduce_scatter_base writes its output only inside wait(), on the
//    current stream: synchronize() alone leaves the output as it was.
// Its name is "gloo", as ProcessGroupGloo's.
namespace vehicle {

class GlooOnVehicle : public c10d::Backend {
 public:
  GlooOnVehicle(c10::intrusive_ptr<c10d::Backend> gloo, std::string name);

  const std::string getBackendName() const override {
    return "gloo";
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  void shutdown() override;
  void abort() override;

 private:
  // The copies' stream, made to wait for the caller's current stream.
  c10::Stream copyStream() const;

  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::string name_;
  int64_t stream_; // the copies' stream
};

} // namespace vehicle
