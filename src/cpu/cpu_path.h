#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <optional>

#include "cpu/cpu_allreduce.h"
#include "cpu/cpu_plan.h"
#include "cpu/cpu_sharded.h"
#include "cpu/gloo_calls.h"
#include "device/device_path.h"
#include "measured/measured_choice.h"
#include "pipeline/collective_engine.h"

namespace fairring {

// CPU tensors on fairring's own engine: allreduce (or Gloo's ring where the
// plan, or the measured choice, says so: choose), reduce-scatter and all-gather
// in every form; every other collective is Gloo's (the CPU delegate).
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
      std::vector<CpuPlanRow> plan,
      std::unique_ptr<MeasuredChoice> measured);
  ~CpuPath() override;

  c10::intrusive_ptr<c10d::Work> delegated(
      const std::vector<at::Tensor>& tensors,
      const Issue& issue,
      Callers callers,
      const std::optional<Announced>& what) override;
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

  const MeasuredChoice* measured() const override {
    return measured_.get();
  }

  CpuAllreduce::Stats stats() const {
    return cpuAllreduce_->stats();
  }

 private:
  // Where an allreduce of `work` runs: the ring or the engine, and the
  // measured choice's turn where its row is measured.
  struct Choice {
    bool ring{false};
    std::optional<MeasuredChoice::Turn> turn;
  };
  // From what every rank shares (size, dtype, op, whether a callback issued
  // it, the plan, the call's number in its class), so that every rank sends
  // the same allreduce the same way.
  Choice choose(const at::Tensor& work, c10d::ReduceOp::RedOpType op);
  // The allreduce of `work` (the caller's `outputs` written by `finish`) the
  // way choose() says, timed where its turn is.
  c10::intrusive_ptr<c10d::Work> runChosen(
      const at::Tensor& work,
      c10d::ReduceOp::RedOpType op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish,
      c10d::OpType opType,
      const char* profilingTitle,
      const std::vector<at::Tensor>& inputs);
  // The allreduce of `work` on Gloo's ring (`timer`: a trial's, started again at the hand-over).
  CpuAllreduce::Ring ringOf(
      const at::Tensor& work,
      c10d::ReduceOp::RedOpType op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish,
      std::shared_ptr<TrialTimer> timer);

  const c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<c10d::Backend> ring_;
  const std::vector<CpuPlanRow> plan_;
  const std::unique_ptr<MeasuredChoice> measured_; // where a row is measured
  TrialTimers timers_;
  std::unique_ptr<CollectiveEngine> engine_;
  std::unique_ptr<CpuAllreduce> cpuAllreduce_; // uses engine_: declared after it
  std::unique_ptr<CpuSharded> cpuSharded_; // uses cpuAllreduce_
  std::unique_ptr<GlooCalls> glooCalls_; // the collectives on gloo_; uses engine_
  int rank_;
};

} // namespace fairring
