#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <optional>

#include "backend/cpu_allreduce.h"
#include "backend/cpu_sharded.h"
#include "backend/device_path.h"
#include "pipeline/allreduce_engine.h"

namespace fairring {

// CPU tensors on fairring's own engine: allreduce (or Gloo's ring where the rule
// says so: ringFor), reduce-scatter and all-gather in every form; every other
// collective is Gloo's (the CPU delegate).
class CpuPath : public DevicePath {
 public:
  // Starts the engine (connects to the peers through `store`).
  CpuPath(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      RankLayout layout,
      const EngineOptions& options,
      c10::intrusive_ptr<c10d::Backend> gloo,
      c10::intrusive_ptr<c10d::Backend> ring,
      int64_t ringFrom);
  ~CpuPath() override;

  c10::intrusive_ptr<c10d::Work> delegated(const std::vector<at::Tensor>& tensors, const Issue& issue) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts)
      override;
  c10::intrusive_ptr<c10d::Work> allreduceCoalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduceScatterBase(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduceScatterList(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduceScatterCoalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allGatherBase(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts)
      override;
  c10::intrusive_ptr<c10d::Work> allGatherList(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allGatherCoalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  void awaitIssued(const c10d::BarrierOptions& opts) override;
  void stop(bool drain) override;

  CpuAllreduce::Stats stats() const {
    return cpuAllreduce_->stats();
  }

 private:
  // The allreduce of `work` on Gloo's ring, where the rule says so
  // (ringFrom) and Gloo reduces its dtype and op; else null.
  CpuAllreduce::Ring ringFor(
      const at::Tensor& work,
      c10d::ReduceOp::RedOpType op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish);

  const c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<c10d::Backend> ring_;
  const int64_t ringFrom_;
  std::unique_ptr<AllreduceEngine> engine_;
  std::unique_ptr<CpuAllreduce> cpuAllreduce_; // uses engine_: declared after it
  std::unique_ptr<CpuSharded> cpuSharded_; // uses cpuAllreduce_
};

} // namespace fairring
