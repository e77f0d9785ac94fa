#include "backend/fairring_backend.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "backend/delegate_path.h"
#include "common/without_gil.h"
#include "cpu/cpu_path.h"
#include "faults/plants.h"
#include "subgroups/composed_path.h"

namespace fairring {

namespace {

// The sub-group path's options with its place in the job: this rank's, from the
// layout every part shares.
SubgroupOptions placed(SubgroupOptions options, const RankLayout& layout) {
  options.rank = layout.rank();
  options.worldSize = layout.worldSize();
  options.localSize = layout.localSize();
  options.numMachines = layout.numMachines();
  options.localRank = layout.localRank();
  options.machine = layout.machine();
  return options;
}

// What a delegated collective says of itself at its turn, the same on every
// rank of a valid program: its elements over `tensors` (where `sized`), their
// dtype, its root and op where it has them.
Announced announcedOf(
    AnnouncedCall call,
    const std::vector<at::Tensor>& tensors,
    int64_t root = -1,
    c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM,
    bool sized = true) {
  int64_t numel = 0;
  for (const at::Tensor& t : tensors) {
    numel += t.defined() ? t.numel() : 0;
  }
  const at::ScalarType dtype = tensors.empty() || !tensors.front().defined() ? at::kFloat : tensors.front().scalar_type();
  return Announced{call, sized ? numel : -1, dtype, op, static_cast<int32_t>(root)};
}

} // namespace

FairringBackend::FairringBackend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    BackendOptions options,
    c10::intrusive_ptr<c10d::Backend> cpuDelegate,
    c10::intrusive_ptr<c10d::Backend> cudaDelegate)
    : c10d::Backend(rank, size),
      cpu_(std::move(cpuDelegate)),
      cuda_(std::move(cudaDelegate)),
      measuredStore_(c10::make_intrusive<c10d::PrefixStore>("measured/", store)),
      accelerator_(options.acceleratorType),
      coalescing_(options.acceleratorType, cuda_) {
  TORCH_CHECK(cpu_, "fairring: a CPU delegate backend is required");
  TORCH_CHECK(
      static_cast<int>(options.machineOf.size()) == size, "fairring: machine_of has ", options.machineOf.size(),
      " entries for a world of ", size);
  RankLayout layout(rank, options.machineOf, options.localRankOf, options.hostnames);
  const SubgroupOptions subgroupOptions = placed(options.subgroup, layout);
  acceleratorPath_ = composedOrDelegate(
      options.cudaSubgroups, subgroupOptions, accelerator_, cuda_, options.cudaUnavailable, options);
  if (options.cpuSubgroups) {
    cpuPath_ = composedOrDelegate(options.cpuSubgroups, subgroupOptions, c10::kCPU, cpu_, "", options);
    return;
  }
  std::vector<std::pair<size_t, bool>> cpuRows;
  for (const CpuPlanRow& row : options.cpuPlan) {
    cpuRows.emplace_back(row.fromBytes, row.way == CpuWay::kMeasured);
  }
  auto measured = measuredChoice("cpu", {"engine", "ring"}, /*kept=*/1, std::move(cpuRows), options);
  cpuPath_ = std::make_unique<CpuPath>(
      store, rank, size, std::move(layout), options.engine, cpu_, options.ringDelegate, options.cpuPlan,
      std::move(measured));
}

std::unique_ptr<MeasuredChoice> FairringBackend::measuredChoice(
    const std::string& device,
    std::array<std::string, 2> ways,
    int kept,
    std::vector<std::pair<size_t, bool>> rows,
    const BackendOptions& options) const {
  bool any = false;
  for (const auto& row : rows) {
    any = any || row.second;
  }
  if (!any) {
    return nullptr;
  }
  MeasuredOptions measured;
  measured.device = device;
  measured.ways = std::move(ways);
  measured.kept = kept;
  measured.rows = std::move(rows);
  for (const auto& [knownDevice, decision] : options.measuredKnown) {
    if (knownDevice == device) {
      measured.known.push_back(decision);
    }
  }
  measured.rank = getRank();
  measured.size = getSize();
  measured.timeout = options.engine.timeout;
  measured.store = measuredStore_;
  measured.onDecision = options.onMeasured;
  return std::make_unique<MeasuredChoice>(std::move(measured));
}

std::unique_ptr<DevicePath> FairringBackend::composedOrDelegate(
    const std::optional<Subgroups>& subgroups,
    const SubgroupOptions& options,
    c10::DeviceType device,
    c10::intrusive_ptr<c10d::Backend> delegate,
    const std::string& unavailable,
    const BackendOptions& backendOptions) {
  bool composes = false;
  std::vector<std::pair<size_t, bool>> rows;
  for (const PlanRow& row : options.plan) {
    composes = composes || row.path == PlanPath::kCompose;
    rows.emplace_back(row.fromBytes, row.measured);
  }
  // A plan that composes nothing leaves the device to its delegate: no stream,
  // event or check of fairring's between the program and NCCL.
  if (subgroups && delegate && (composes || plants::planted(plants::Plant::kDirectThroughOurStreams))) {
    const bool cpu = device == c10::kCPU;
    auto measured = measuredChoice(
        cpu ? "cpu" : c10::DeviceTypeName(device, /*lower_case=*/true),
        {cpu ? "gloo" : backendOptions.acceleratorDelegateName, "composed"}, /*kept=*/0, std::move(rows),
        backendOptions);
    return std::make_unique<ComposedPath>(
        std::make_unique<SubgroupAllreduce>(*subgroups, options, device), delegate, std::move(measured),
        backendOptions.ownStream);
  }
  return std::make_unique<DelegatePath>(delegate, getRank(), unavailable);
}

FairringBackend::~FairringBackend() {
  WithoutGil released;
  try {
    stopPaths(/*drain=*/true);
  } catch (const std::exception& e) {
    TORCH_WARN("fairring: shutting down rank ", getRank(), " failed: ", e.what());
  }
  // Destroyed here, without the GIL, not after this body: the groups join
  // their threads (without_gil.h says why that must not wait under the GIL).
  acceleratorPath_.reset();
  cpuPath_.reset();
  cuda_.reset();
  cpu_.reset();
}

std::optional<CpuAllreduce::Stats> FairringBackend::cpuAllreduceStats() const {
  const auto* path = dynamic_cast<const CpuPath*>(cpuPath_.get());
  return path != nullptr ? std::optional<CpuAllreduce::Stats>(path->stats()) : std::nullopt;
}

const SubgroupAllreduce* FairringBackend::subgroupAllreduce(c10::DeviceType device) const {
  const DevicePath* path = device == accelerator_ ? acceleratorPath_.get()
      : device == c10::kCPU                       ? cpuPath_.get()
                                                  : nullptr;
  const auto* composed = dynamic_cast<const ComposedPath*>(path);
  return composed != nullptr ? &composed->composition() : nullptr;
}

std::vector<std::string> FairringBackend::measuredDecisions(c10::DeviceType device) const {
  const DevicePath* path = device == accelerator_ ? acceleratorPath_.get()
      : device == c10::kCPU                       ? cpuPath_.get()
                                                  : nullptr;
  const MeasuredChoice* measured = path != nullptr ? path->measured() : nullptr;
  std::vector<std::string> out;
  if (measured != nullptr) {
    const std::string name = device == c10::kCPU ? "cpu" : c10::DeviceTypeName(device, /*lower_case=*/true);
    for (const MeasuredDecision& d : measured->decisions()) {
      out.push_back(decisionJson(name, measured->ways(), d));
    }
  }
  return out;
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(
      tensors.size() == 1, "fairring: allreduce takes exactly one tensor per process, got ", tensors.size());
  if (auto work = inBlock([=](c10d::Backend& b) mutable { return b.allreduce(tensors, opts); }, tensors)) {
    return *work;
  }
  return pathFor(tensors).allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "fairring: allreduce_coalesced needs at least one tensor");
  if (auto work = inBlock([=](c10d::Backend& b) mutable { return b.allreduce_coalesced(tensors, opts); }, tensors)) {
    return *work;
  }
  return pathFor(tensors.front()).allreduceCoalesced(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (auto work = inBlock([=](c10d::Backend& b) mutable { return b.allgather(outputs, inputs, opts); }, inputs, outputs)) {
    return *work;
  }
  return pathFor(inputs, outputs).allGatherList(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  if (auto work = inBlock([=](c10d::Backend& b) mutable { return b._allgather_base(output, input, opts); }, input, output)) {
    return *work;
  }
  return pathFor(input, output).allGatherBase(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (auto work = inBlock([=](c10d::Backend& b) mutable { return b.allgather_into_tensor_coalesced(outputs, inputs, opts); }, inputs, outputs)) {
    return *work;
  }
  return pathFor(inputs, outputs).allGatherCoalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (auto work = inBlock([=](c10d::Backend& b) mutable { return b.reduce_scatter(outputs, inputs, opts); }, outputs, inputs)) {
    return *work;
  }
  return pathFor(outputs, inputs).reduceScatterList(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  if (auto work = inBlock([=](c10d::Backend& b) mutable { return b._reduce_scatter_base(output, input, opts); }, input, output)) {
    return *work;
  }
  return pathFor(input, output).reduceScatterBase(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (auto work = inBlock([=](c10d::Backend& b) mutable { return b.reduce_scatter_tensor_coalesced(outputs, inputs, opts); }, inputs, outputs)) {
    return *work;
  }
  return pathFor(inputs, outputs).reduceScatterCoalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return delegate(
      announcedOf(AnnouncedCall::kBroadcast, tensors, opts.rootRank),
      [=](c10d::Backend& b) mutable { return b.broadcast(tensors, opts); }, tensors);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return delegate(
      announcedOf(AnnouncedCall::kAllreduceSparse, tensors, -1, opts.reduceOp.op_, /*sized=*/false),
      [=](c10d::Backend& b) mutable { return b.allreduce_sparse(tensors, opts); }, tensors);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  return delegate(
      announcedOf(AnnouncedCall::kReduce, tensors, opts.rootRank, opts.reduceOp.op_),
      [=](c10d::Backend& b) mutable { return b.reduce(tensors, opts); }, tensors);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return delegate(
      announcedOf(AnnouncedCall::kAllGatherCoalesced, inputs),
      [=](c10d::Backend& b) mutable { return b.allgather_coalesced(outputs, inputs, opts); }, inputs, outputs);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return delegate(
      announcedOf(AnnouncedCall::kGather, inputs, opts.rootRank),
      [=](c10d::Backend& b) mutable { return b.gather(outputs, inputs, opts); }, inputs, outputs);
}

#if FAIRRING_C10D_HAS_GATHER_SINGLE
c10::intrusive_ptr<c10d::Work> FairringBackend::gather_single(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::GatherOptions& opts) {
  return delegate(
      announcedOf(AnnouncedCall::kGather, {input}, opts.rootRank),
      [=](c10d::Backend& b) mutable { return b.gather_single(output, input, opts); }, input, output);
}
#endif

c10::intrusive_ptr<c10d::Work> FairringBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return delegate(
      announcedOf(AnnouncedCall::kScatter, outputs, opts.rootRank),
      [=](c10d::Backend& b) mutable { return b.scatter(outputs, inputs, opts); }, outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  // Split sizes may differ between ranks; without them every rank's input is alike.
  const bool even = outputSplitSizes.empty() && inputSplitSizes.empty();
  return delegate(
      announcedOf(AnnouncedCall::kAllToAll, {input}, -1, c10d::ReduceOp::SUM, even),
      [=](c10d::Backend& b) mutable { return b.alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts); },
      input, output);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  return delegate(
      announcedOf(AnnouncedCall::kAllToAll, inputs, -1, c10d::ReduceOp::SUM, /*sized=*/false),
      [=](c10d::Backend& b) mutable { return b.alltoall(outputs, inputs, opts); }, inputs, outputs);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return delegatePair([=](c10d::Backend& b) mutable { return b.send(tensors, dstRank, tag); }, tensors);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return delegatePair([=](c10d::Backend& b) mutable { return b.recv(tensors, srcRank, tag); }, tensors);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return delegatePair([=](c10d::Backend& b) mutable { return b.recvAnysource(tensors, tag); }, tensors);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::barrier(const c10d::BarrierOptions& opts) {
  // Gloo's barrier completes only after the work queued before it on the
  // group (programs read results after it), and the delegate's does that for
  // what it runs; what fairring runs itself is waited for here, before the
  // ranks synchronise, so that past the barrier it is done on every rank. A
  // failure of the group raises here on every rank alike: the CPU engine's
  // barrier takes its turn, and fails wherever the group failed before it.
  cpuPath_->awaitIssued(opts);
  acceleratorPath_->awaitIssued(opts);
  return cpu_->barrier(opts);
}

void FairringBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  cpuPath_->awaitIssued(opts);
  acceleratorPath_->awaitIssued(opts);
  cpu_->monitoredBarrier(opts, waitAllRanks);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::delegateAs(
    DevicePath::Callers callers,
    const DevicePath::Issue& issue,
    const std::vector<at::Tensor>& tensors,
    const std::optional<Announced>& what) {
  DevicePath& path = pathFor(tensors);
  coalescing_.enter(&path == acceleratorPath_.get() ? accelerator_ : c10::kCPU);
  c10::intrusive_ptr<c10d::Work> work = path.delegated(tensors, issue, callers, what);
  coalescing_.keep(work, tensors);
  return work;
}

void FairringBackend::startCoalescing() {
  coalescing_.start();
}

c10::intrusive_ptr<c10d::Work> FairringBackend::endCoalescing() {
  // The delegate's block ends as one of its calls over every tensor of the
  // block (its calls inside returned no Work), ordered as the path orders the
  // delegate's calls; who made its calls, each said so when it entered.
  return coalescing_.end([this](const std::vector<at::Tensor>& tensors, const std::function<c10::intrusive_ptr<c10d::Work>()>& end) {
    return acceleratorPath_->delegated(
        tensors, [&](c10d::Backend&) { return end(); }, DevicePath::Callers::kSomeRanks, std::nullopt);
  });
}

void FairringBackend::setSequenceNumberForGroup() {
  cpu_->setSequenceNumberForGroup();
}

uint64_t FairringBackend::getSequenceNumberForGroup() {
  return cpu_->getSequenceNumberForGroup();
}

void FairringBackend::stopPaths(bool drain) {
  // A destroy lets the device finish what this rank issued (peers may still
  // need its sends); an abort stops at once.
  acceleratorPath_->stop(drain);
  cpuPath_->stop(drain);
}

void FairringBackend::shutdown() {
  WithoutGil released;
  stopPaths(/*drain=*/true);
  cpu_->shutdown();
  if (cuda_) {
    cuda_->shutdown();
  }
}

void FairringBackend::abort() {
  WithoutGil released;
  stopPaths(/*drain=*/false);
  cpu_->abort();
  if (cuda_) {
    cuda_->abort();
  }
}

} // namespace fairring
