#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/headeronly/version.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <optional>

#include "backend/cpu_allreduce.h"
#include "backend/cpu_sharded.h"
#include "pipeline/allreduce_engine.h"
#include "subgroups/subgroup_allreduce.h"

// torch 2.14 added c10d::Backend::gather_single (a gather into one flat tensor). Its
// default forwards to gather_into_tensor, which forwards back to it and throws
// "does not support": like every collective fairring does not run, it goes to the
// delegate (NCCL has it; Gloo throws the same way).
#define FAIRRING_C10D_HAS_GATHER_SINGLE \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14))

namespace fairring {

// What the Python layer decided before creating the backend (it validates the
// environment and discovers the topology; see fairring_pg/backend.py). Every
// default and sizing rule is fairring_pg.config's: the core is handed numbers.
struct BackendOptions {
  size_t sliceSize{0};
  size_t stagingSlotBytes{0}; // fairring_pg.config.staging_slot_bytes of sliceSize
  size_t totalMemory{0};
  std::vector<int> machineOf;
  std::vector<int> localRankOf; // fairring_pg.topology's local rank of every rank
  std::vector<std::string> hostnames;
  std::string listenAddress;
  std::string jobToken;
  std::chrono::milliseconds timeout{0};
  std::string timelinePath; // this rank's trace file; empty: off
  size_t pipelineChunk{0}; // each local rank's part of the piece of a slice the five steps move at once
  // CPU allreduces of this many bytes or more go to Gloo's ring (ringDelegate)
  // instead of the engine; -1: none (fairring_pg.config.cpu_ring_from).
  int64_t cpuRingFrom{-1};
  // A Gloo group of its own for the ring: on the CPU delegate the program's
  // ring allreduces would interleave with collectives issued from callbacks
  // differently on each rank. Set where cpuRingFrom >= 0.
  c10::intrusive_ptr<c10d::Backend> ringDelegate;
  // The sub-group allreduce (src/subgroups/): its plan (what each size runs,
  // fairring_pg.model.cuda_plan), the largest piece (fitted so that every
  // lane has its staging) and each lane's staging (fairring_pg.config).
  std::vector<PlanRow> subgroupPlan;
  size_t largestPieceBytes{0};
  size_t laneStagingBytes{0};
  // NCCL groups for CUDA tensors; unset without CUDA and NCCL, or where
  // ranks share a GPU (then CUDA allreduces go to the CUDA delegate).
  std::optional<Subgroups> cudaSubgroups;
  // The device type whose tensors take the CUDA side (the sub-groups above
  // and the CUDA delegate): CUDA, or in tests the stream vehicle
  // (tests/native/), a PrivateUse1 device that records every stream order.
  c10::DeviceType acceleratorType{c10::kCUDA};
  // Why there is no CUDA delegate, decided alike on every rank
  // (fairring_pg/cuda.py): what a collective on CUDA tensors raises.
  std::string cudaUnavailable;
  // Gloo groups that make CPU tensors take the sub-group path instead of the
  // TCP engine: the test switch FAIRRING_TEST_CPU_SUBGROUPS.
  std::optional<Subgroups> cpuSubgroups;
};

// The c10d backend: allreduce on CPU tensors runs the reduction-server
// pipeline over fairring's own TCP mesh, on CUDA tensors the same algorithm
// composed of NCCL sub-group collectives; reduce-scatter and all-gather on CPU
// tensors run on the same engine (CUDA: NCCL's own); every other collective
// goes to the delegate backend for the tensors' device.
class FairringBackend : public c10d::Backend {
 public:
  FairringBackend(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      BackendOptions options,
      c10::intrusive_ptr<c10d::Backend> cpuDelegate,
      c10::intrusive_ptr<c10d::Backend> cudaDelegate);
  ~FairringBackend() override;

  const std::string getBackendName() const override {
    return "fairring";
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;

  // Delegated.
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
#if FAIRRING_C10D_HAS_GATHER_SINGLE
  c10::intrusive_ptr<c10d::Work> gather_single(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
#endif
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;

  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  void shutdown() override;
  void abort() override;

  // What CpuAllreduce has run where; empty where CPU tensors take the sub-group path.
  std::optional<CpuAllreduce::Stats> cpuAllreduceStats() const {
    return cpuAllreduce_ ? std::optional<CpuAllreduce::Stats>(cpuAllreduce_->stats()) : std::nullopt;
  }

  // The sub-group allreduce of `device`'s tensors (null where that device's
  // allreduces do not take it), for its counters.
  const SubgroupAllreduce* subgroupAllreduce(c10::DeviceType device) const {
    return device == accelerator_ ? cudaSubgroups_.get() : device == c10::kCPU ? cpuSubgroups_.get() : nullptr;
  }

 private:
  // The allreduce of `work` on the CPU delegate's ring, where the rule says so
  // (BackendOptions::cpuRingFrom) and Gloo reduces its dtype and op; else null.
  CpuAllreduce::Ring ringFor(
      const at::Tensor& work,
      c10d::ReduceOp::RedOpType op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish);

  // barrier(): waits on the host for every allreduce of the sub-group paths.
  void awaitSubgroups();

  // Stops fairring's own engines (not the delegates): `drain` lets what the
  // device still runs finish first (destroy), else it is aborted.
  void shutdownCore(bool drain);

  void releaseRing();

  // The delegate for the device of the first defined tensor of `sets`
  // (tensors, lists of them, lists of lists); on CUDA, what it is given runs
  // after the allreduces in flight on the same memory.
  template <typename... Sets>
  c10d::Backend& delegateFor(const Sets&... sets) {
    std::vector<at::Tensor> all;
    (collect(all, sets), ...);
    return delegateForAll(all);
  }
  c10d::Backend& delegateForAll(const std::vector<at::Tensor>& tensors);
  // What the delegate returned for accelerator tensors: the allreduces issued
  // later on the same memory wait for it, as they would behind NCCL's one
  // stream (SubgroupAllreduce::orderAfter).
  c10::intrusive_ptr<c10d::Work> track(c10::intrusive_ptr<c10d::Work> work);
  // Whether a reduce-scatter or all-gather of `sets` runs on fairring's CPU
  // engine: its first defined tensor is not on a GPU (as delegateFor decides).
  template <typename... Sets>
  bool onCpuEngine(const Sets&... sets) {
    std::vector<at::Tensor> all;
    (collect(all, sets), ...);
    for (const at::Tensor& t : all) {
      if (t.defined()) {
        return cpuSharded_ && !onAccelerator(t);
      }
    }
    return cpuSharded_ != nullptr;
  }
  bool onAccelerator(const at::Tensor& t) const {
    return t.device().type() == accelerator_;
  }
  static void collect(std::vector<at::Tensor>& all, const at::Tensor& t) {
    all.push_back(t);
  }
  static void collect(std::vector<at::Tensor>& all, const std::vector<at::Tensor>& ts) {
    all.insert(all.end(), ts.begin(), ts.end());
  }
  static void collect(std::vector<at::Tensor>& all, const std::vector<std::vector<at::Tensor>>& lists) {
    for (const auto& list : lists) {
      collect(all, list);
    }
  }

  c10::intrusive_ptr<c10d::Backend> cpu_;
  c10::intrusive_ptr<c10d::Backend> cuda_;
  c10::intrusive_ptr<c10d::Backend> ring_;
  const c10::DeviceType accelerator_; // CUDA, or the stream vehicle in tests
  const std::string cudaUnavailable_;
  const int64_t cpuRingFrom_;
  std::unique_ptr<AllreduceEngine> engine_; // null when CPU tensors take the sub-group path
  std::unique_ptr<CpuAllreduce> cpuAllreduce_; // uses engine_: declared after it
  std::unique_ptr<CpuSharded> cpuSharded_; // uses cpuAllreduce_
  std::unique_ptr<SubgroupAllreduce> cpuSubgroups_;
  std::unique_ptr<SubgroupAllreduce> cudaSubgroups_;
};

} // namespace fairring
