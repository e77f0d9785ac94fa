#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/headeronly/version.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <optional>

#include "backend/coalescing_block.h"
#include "cpu/cpu_allreduce.h"
#include "cpu/cpu_plan.h"
#include "device/device_path.h"
#include "measured/measured_choice.h"
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
// default is fairring_pg.config's table, every size fairring_pg.sizing's rule:
// the core is handed numbers.
struct BackendOptions {
  // The job's layout (fairring_pg.topology): every part takes its place from it.
  std::vector<int> machineOf;
  std::vector<int> localRankOf;
  std::vector<std::string> hostnames;
  // Each path's own options, bound as they are (Options.engine, Options.subgroup):
  // fairring_pg.backend fills them from the settings table and the sizing rules.
  EngineOptions engine;
  SubgroupOptions subgroup; // its rank and shape are the layout's (placed() here)
  // What each size of CPU allreduce runs: the engine, Gloo's ring
  // (ringDelegate) or the measured choice between them
  // (fairring_pg.model.cpu_plan, FAIRRING_CPU_ALLREDUCE).
  std::vector<CpuPlanRow> cpuPlan{CpuPlanRow{}};
  // A Gloo group of its own for the ring: on the CPU delegate the program's
  // ring allreduces would interleave with collectives issued from callbacks
  // differently on each rank. Set where a row of cpuPlan is not the engine's.
  c10::intrusive_ptr<c10d::Backend> ringDelegate;
  // The measured choice (src/measured/, FAIRRING_*_ALLREDUCE=auto): the
  // decisions FAIRRING_PLAN_FILE held, by device ("cpu", "cuda"), what the
  // accelerator's delegate is called in them, and who is told of each new
  // one (fairring_pg.measured: the log and the file). Its agreements go
  // through the group's store.
  std::vector<std::pair<std::string, MeasuredDecision>> measuredKnown;
  std::string acceleratorDelegateName{"nccl"};
  std::function<void(const std::string&, const std::string&)> onMeasured;
  // Makes the accelerator's trial timers a stream of their own
  // (fairring_pg.cuda.own_stream); unset, they cannot time.
  StreamMaker ownStream;
  // NCCL groups for CUDA tensors (the world group alone where the plan
  // composes nothing); unset without CUDA and NCCL, or where ranks share a
  // GPU (then CUDA allreduces go to the CUDA delegate).
  std::optional<Subgroups> cudaSubgroups;
  // The device type whose tensors take the CUDA side (the sub-groups above
  // and the CUDA delegate): CUDA, or in tests the stream vehicle
  // (tests/native/), a PrivateUse1 device that records every stream order.
  c10::DeviceType acceleratorType{c10::kCUDA};
  // Why there is no CUDA delegate, decided alike on every rank
  // (fairring_pg/cuda/decision.py): what a collective on CUDA tensors raises.
  std::string cudaUnavailable;
  // Gloo groups that make CPU tensors take the sub-group path instead of the
  // TCP engine: the test switch FAIRRING_TEST_CPU_SUBGROUPS.
  std::optional<Subgroups> cpuSubgroups;
};

// The c10d backend: each device's tensors take that device's path
// (device_path.h), chosen once here: CPU tensors fairring's engine, CUDA
// tensors the composition of NCCL sub-group collectives where the plan
// composes some call, else NCCL's own. Every collective asks the path of its
// tensors' device; none branches on the device itself.
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
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
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

  // Always the delegate's.
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
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

  // Coalescing blocks (batch_isend_irecv): the accelerator delegate's where
  // it has them (coalescing_block.h).
  bool supportsCoalescing() const override {
    return coalescing_.supported();
  }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  void shutdown() override;
  void abort() override;

  // What fairring's CPU engine has run where; empty where CPU tensors take
  // another path.
  std::optional<CpuAllreduce::Stats> cpuAllreduceStats() const;
  // The sub-group allreduce of `device`'s tensors (null where that device's
  // path does not compose), for its counters.
  const SubgroupAllreduce* subgroupAllreduce(c10::DeviceType device) const;
  // The measured choice's decisions for `device`'s allreduces so far (JSON,
  // as fairring_pg.measured reads them); empty where it has none.
  std::vector<std::string> measuredDecisions(c10::DeviceType device) const;

 private:
  // The path of a device whose collectives may be composed of `subgroups`
  // (where the plan composes some call), else its delegate's.
  std::unique_ptr<DevicePath> composedOrDelegate(
      const std::optional<Subgroups>& subgroups,
      const SubgroupOptions& options,
      c10::DeviceType device,
      c10::intrusive_ptr<c10d::Backend> delegate,
      const std::string& unavailable,
      const BackendOptions& backendOptions);
  // The measured choice of `device`'s allreduces between `ways` (`kept`: the
  // program's own), over the plan's `rows` (from bytes, measured); null where
  // no row is measured.
  std::unique_ptr<MeasuredChoice> measuredChoice(
      const std::string& device,
      std::array<std::string, 2> ways,
      int kept,
      std::vector<std::pair<size_t, bool>> rows,
      const BackendOptions& options) const;

  // The path of the device of the first defined tensor of `sets` (tensors,
  // lists of them, lists of lists); the CPU's where none is defined.
  template <typename... Sets>
  DevicePath& pathFor(const Sets&... sets) {
    for (const at::Tensor& t : tensorsOf(sets...)) {
      if (t.defined()) {
        return t.device().type() == accelerator_ ? *acceleratorPath_ : *cpuPath_;
      }
    }
    return *cpuPath_;
  }
  // A collective that always goes to the delegate of its tensors' device,
  // announced as `what` where the path checks it across ranks.
  template <typename... Sets>
  c10::intrusive_ptr<c10d::Work> delegate(const Announced& what, const DevicePath::Issue& issue, const Sets&... sets) {
    return delegateAs(DevicePath::Callers::kEveryRank, issue, tensorsOf(sets...), what);
  }
  // A point-to-point call (two ranks of the group make it).
  c10::intrusive_ptr<c10d::Work> delegatePair(const DevicePath::Issue& issue, const std::vector<at::Tensor>& tensors) {
    return delegateAs(DevicePath::Callers::kSomeRanks, issue, tensors, std::nullopt);
  }
  // Through the path of the tensors' device, inside a coalescing block if one is open.
  c10::intrusive_ptr<c10d::Work> delegateAs(
      DevicePath::Callers callers,
      const DevicePath::Issue& issue,
      const std::vector<at::Tensor>& tensors,
      const std::optional<Announced>& what);
  // A collective fairring may run itself, given to the delegate because a
  // coalescing block is open: the Work, or none where no block is open.
  template <typename... Sets>
  std::optional<c10::intrusive_ptr<c10d::Work>> inBlock(const DevicePath::Issue& issue, const Sets&... sets) {
    if (!coalescing_.open()) {
      return std::nullopt;
    }
    std::vector<at::Tensor> tensors = tensorsOf(sets...);
    const Announced what{
        AnnouncedCall::kBlockCall, -1, tensors.empty() ? at::kFloat : tensors.front().scalar_type()};
    return delegateAs(DevicePath::Callers::kEveryRank, issue, tensors, what);
  }

  // Stops fairring's own paths (not the delegates): `drain` lets what the
  // device still runs finish first (destroy), else it is aborted.
  void stopPaths(bool drain);

  c10::intrusive_ptr<c10d::Backend> cpu_;
  c10::intrusive_ptr<c10d::Backend> cuda_;
  // The measured choice's agreements' keys ("measured/" in the group's store).
  const c10::intrusive_ptr<c10d::Store> measuredStore_;
  const c10::DeviceType accelerator_; // CUDA, or the stream vehicle in tests
  std::unique_ptr<DevicePath> cpuPath_;
  std::unique_ptr<DevicePath> acceleratorPath_;
  CoalescingBlock coalescing_;
};

} // namespace fairring
