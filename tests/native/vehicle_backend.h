#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>
#include <string>
#include <vector>

// A stand-in for ProcessGroupNCCL on the stream vehicle (vehicle_device.h),
// over a Gloo group: each collective runs on a communication stream of the
// group's own, which first waits for the caller's current stream; the
// allocator is told that its tensors are used there (as ProcessGroupNCCL's
// record_stream); its Work's wait(), synchronize() and blockCurrentStream()
// make the caller's current stream wait for the collective's end, without the
// host waiting; its future is marked on the communication stream. The bytes
// move through Gloo, at once, on host views of the vehicle tensors.
namespace vehicle {

class StreamedBackend : public c10d::Backend {
 public:
  StreamedBackend(c10::intrusive_ptr<c10d::Backend> gloo, std::string name);

  const std::string getBackendName() const override {
    return "vehicle";
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

  c10d::ErrorType getError() override {
    return c10d::ErrorType::SUCCESS;
  }
  void shutdown() override;
  void abort() override;

  // How many collectives this group has run (tests check what went where).
  int64_t collectives() const {
    return collectives_;
  }

 private:
  // Runs `onHost` (the Gloo collective on host views) as one launch on the
  // communication stream, ordered as ProcessGroupNCCL orders its kernels.
  c10::intrusive_ptr<c10d::Work> run(
      const std::string& op,
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs,
      const std::function<void()>& onHost);

  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::string name_;
  int64_t stream_; // the communication stream's id
  int64_t collectives_{0};
};

} // namespace vehicle
