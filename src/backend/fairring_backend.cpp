#include "backend/fairring_backend.h"
#include "backend/without_gil.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "ops/reduce_kind.h"
#include "ops/tensor_fusion.h"

namespace fairring {

namespace {

// Everything the CPU pipeline cannot take, refused before anything is sent.
void checkCpuTensor(const at::Tensor& t, const std::string& name) {
  TORCH_CHECK(t.defined(), "fairring: ", name, " is undefined");
  TORCH_CHECK(
      t.layout() == at::kStrided, "fairring: ", name, " has layout ", t.layout(),
      "; allreduce supports dense (strided) tensors only");
  TORCH_CHECK(
      t.device().is_cpu(), "fairring: ", name, " is on device ", t.device(),
      "; expected a CPU or CUDA tensor");
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
      ring_(options.ringDelegate),
      accelerator_(options.acceleratorType),
      cudaUnavailable_(options.cudaUnavailable),
      cpuRingFrom_(options.cpuRingFrom) {
  TORCH_CHECK(cpu_, "fairring: a CPU delegate backend is required");
  TORCH_CHECK(
      static_cast<int>(options.machineOf.size()) == size, "fairring: machine_of has ", options.machineOf.size(),
      " entries for a world of ", size);
  RankLayout layout(rank, options.machineOf, options.localRankOf, options.hostnames);
  SubgroupOptions subgroupOptions;
  subgroupOptions.rank = rank;
  subgroupOptions.worldSize = size;
  subgroupOptions.localSize = layout.localSize();
  subgroupOptions.numMachines = layout.numMachines();
  subgroupOptions.localRank = layout.localRank();
  subgroupOptions.machine = layout.machine();
  subgroupOptions.timeout = options.timeout;
  subgroupOptions.plan = options.subgroupPlan;
  subgroupOptions.largestPieceBytes = options.largestPieceBytes;
  subgroupOptions.laneStagingBytes = options.laneStagingBytes;
  subgroupOptions.totalMemory = options.totalMemory;
  if (options.cudaSubgroups) {
    cudaSubgroups_ = std::make_unique<SubgroupAllreduce>(*options.cudaSubgroups, subgroupOptions, accelerator_);
  }
  if (options.cpuSubgroups) {
    cpuSubgroups_ = std::make_unique<SubgroupAllreduce>(*options.cpuSubgroups, subgroupOptions, c10::kCPU);
    return;
  }
  TORCH_CHECK(cpuRingFrom_ < 0 || ring_, "fairring: allreduces on the ring need a ring delegate");
  EngineOptions engineOptions{
      options.sliceSize, options.stagingSlotBytes, options.totalMemory, options.timeout, options.listenAddress,
      options.jobToken, options.timelinePath, options.pipelineChunk};
  engine_ = std::make_unique<AllreduceEngine>(std::move(layout), engineOptions);
  engine_->start(*store);
  cpuAllreduce_ = std::make_unique<CpuAllreduce>(
      rank, *engine_, engineOptions, c10::make_intrusive<c10d::PrefixStore>("callbacks/", store));
  cpuSharded_ = std::make_unique<CpuSharded>(*cpuAllreduce_, size);
}

FairringBackend::~FairringBackend() {
  WithoutGil released;
  try {
    shutdownCore(/*drain=*/true);
  } catch (const std::exception& e) {
    TORCH_WARN("fairring: shutting down rank ", getRank(), " failed: ", e.what());
  }
  // Destroyed here, without the GIL, not after this body: the groups join
  // their threads (without_gil.h says why that must not wait under the GIL).
  cudaSubgroups_.reset();
  cpuSubgroups_.reset();
  cpuSharded_.reset();
  cpuAllreduce_.reset();
  engine_.reset();
  ring_.reset();
  cuda_.reset();
  cpu_.reset();
}

namespace {
// The accelerator tensors of the collective being handed to the delegate on
// this thread, between delegateForAll and track.
thread_local std::vector<at::Tensor> tDelegated;
} // namespace

c10d::Backend& FairringBackend::delegateForAll(const std::vector<at::Tensor>& tensors) {
  tDelegated.clear();
  for (const at::Tensor& tensor : tensors) {
    if (!tensor.defined()) {
      continue;
    }
    if (!onAccelerator(tensor)) {
      return *cpu_;
    }
    TORCH_CHECK(cuda_, "fairring: rank ", getRank(), ": ", cudaUnavailable_);
    if (cudaSubgroups_) {
      cudaSubgroups_->orderBefore(tensors);
      tDelegated = tensors;
    }
    return *cuda_;
  }
  return *cpu_;
}

c10::intrusive_ptr<c10d::Work> FairringBackend::track(c10::intrusive_ptr<c10d::Work> work) {
  std::vector<at::Tensor> tensors;
  tensors.swap(tDelegated);
  if (!tensors.empty() && work) {
    cudaSubgroups_->orderAfter(tensors, *work);
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(
      tensors.size() == 1, "fairring: allreduce takes exactly one tensor per process, got ", tensors.size());
  at::Tensor& tensor = tensors[0];
  if (tensor.defined() && onAccelerator(tensor)) {
    if (cudaSubgroups_) {
      return cudaSubgroups_->allreduce(tensor, opts.reduceOp.op_);
    }
    return track(delegateFor(tensors).allreduce(tensors, opts));
  }
  if (cpuSubgroups_) {
    return cpuSubgroups_->allreduce(tensor, opts.reduceOp.op_);
  }
  checkCpuTensor(tensor, "the allreduce tensor");
  at::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
  std::function<void()> finish;
  if (!work.is_same(tensor)) {
    // Reduce a dense copy, then write the result back into the caller's view.
    finish = [tensor, work]() mutable { tensor.copy_(work); };
  }
  CpuAllreduce::Ring ring = ringFor(work, opts.reduceOp.op_, {tensor}, finish);
  return cpuAllreduce_->run(
      work, opts.reduceOp.op_, {tensor}, std::move(finish), c10d::OpType::ALLREDUCE, "fairring:all_reduce", tensors,
      ring);
}

CpuAllreduce::Ring FairringBackend::ringFor(
    const at::Tensor& work,
    c10d::ReduceOp::RedOpType op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish) {
  // Decided from what every rank shares (size, dtype, op, the job's shape), so
  // that every rank sends the same allreduce the same way.
  const int64_t bytes = work.numel() * static_cast<int64_t>(work.element_size());
  if (cpuRingFrom_ < 0 || bytes < cpuRingFrom_ || !glooReduces(work.scalar_type(), op)) {
    return nullptr;
  }
  return [this, work, op, bytes, outputs = std::move(outputs), finish = std::move(finish)]() {
    std::vector<at::Tensor> tensors{work};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp(op);
    auto ring = ring_->allreduce(tensors, opts)->getFuture();
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    ring->addCallback([done, outputs, finish, bytes](c10::ivalue::Future& f) {
      if (f.hasError()) {
        // Gloo's message names the peer by address; say where it comes from.
        done->setError(std::make_exception_ptr(c10::DistBackendError(
            "fairring: an allreduce of " + std::to_string(bytes) +
            " bytes on Gloo's ring (one rank per machine: FAIRRING_CPU_ALLREDUCE) failed: " +
            f.tryRetrieveErrorMessage())));
        return;
      }
      try {
        // The write-back (non-contiguous, coalesced) before anyone sees it done.
        if (finish) {
          finish();
        }
        done->markCompleted(c10::IValue(outputs));
      } catch (const std::exception& e) {
        done->setError(std::make_exception_ptr(
            c10::DistBackendError(std::string("fairring: completing an allreduce failed: ") + e.what())));
      }
    });
    return done;
  };
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "fairring: allreduce_coalesced needs at least one tensor");
  if (tensors[0].defined() && onAccelerator(tensors[0])) {
    if (cudaSubgroups_) {
      return cudaSubgroups_->allreduceCoalesced(tensors, opts.reduceOp.op_);
    }
    return track(delegateFor(tensors).allreduce_coalesced(tensors, opts));
  }
  if (cpuSubgroups_) {
    return cpuSubgroups_->allreduceCoalesced(tensors, opts.reduceOp.op_);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = "tensor " + std::to_string(i) + " of allreduce_coalesced";
    checkCpuTensor(tensors[i], name);
    TORCH_CHECK(
        tensors[i].scalar_type() == tensors[0].scalar_type(), "fairring: ", name, " has dtype torch.",
        dtypeName(tensors[i].scalar_type()), " but tensor 0 has torch.", dtypeName(tensors[0].scalar_type()),
        "; coalesced tensors must share a dtype");
  }
  Fusion fusion = fuse(tensors);
  CpuAllreduce::Ring ring = ringFor(fusion.fused, opts.reduceOp.op_, tensors, fusion.scatterBack);
  return cpuAllreduce_->run(
      fusion.fused, opts.reduceOp.op_, tensors, std::move(fusion.scatterBack), c10d::OpType::ALLREDUCE_COALESCED,
      "fairring:all_reduce_coalesced", tensors, ring);
}

c10::intrusive_ptr<c10d::Work> FairringBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return track(delegateFor(tensors).broadcast(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return track(delegateFor(tensors).allreduce_sparse(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  return track(delegateFor(tensors).reduce(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (onCpuEngine(inputs, outputs)) {
    return cpuSharded_->allGatherList(outputs, inputs);
  }
  return track(delegateFor(inputs, outputs).allgather(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  if (onCpuEngine(input, output)) {
    return cpuSharded_->allGatherBase(output, input);
  }
  return track(delegateFor(input, output)._allgather_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return track(delegateFor(inputs, outputs).allgather_coalesced(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (onCpuEngine(inputs, outputs)) {
    return cpuSharded_->allGatherCoalesced(outputs, inputs);
  }
  return track(delegateFor(inputs, outputs).allgather_into_tensor_coalesced(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return track(delegateFor(inputs, outputs).gather(outputs, inputs, opts));
}

#if FAIRRING_C10D_HAS_GATHER_SINGLE
c10::intrusive_ptr<c10d::Work> FairringBackend::gather_single(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::GatherOptions& opts) {
  return track(delegateFor(input, output).gather_single(output, input, opts));
}
#endif

c10::intrusive_ptr<c10d::Work> FairringBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return track(delegateFor(outputs, inputs).scatter(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (onCpuEngine(outputs, inputs)) {
    return cpuSharded_->reduceScatterList(outputs, inputs, opts.reduceOp.op_);
  }
  return track(delegateFor(outputs, inputs).reduce_scatter(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  if (onCpuEngine(input, output)) {
    return cpuSharded_->reduceScatterBase(output, input, opts.reduceOp.op_);
  }
  return track(delegateFor(input, output)._reduce_scatter_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (onCpuEngine(inputs, outputs)) {
    return cpuSharded_->reduceScatterCoalesced(outputs, inputs, opts.reduceOp.op_);
  }
  return track(delegateFor(inputs, outputs).reduce_scatter_tensor_coalesced(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  return track(delegateFor(input, output).alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  return track(delegateFor(inputs, outputs).alltoall(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return track(delegateFor(tensors).send(tensors, dstRank, tag));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return track(delegateFor(tensors).recv(tensors, srcRank, tag));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return track(delegateFor(tensors).recvAnysource(tensors, tag));
}

c10::intrusive_ptr<c10d::Work> FairringBackend::barrier(const c10d::BarrierOptions& opts) {
  // Gloo's barrier completes only after the work queued before it on the
  // group (programs read results after it), and the delegate's does that for
  // what it runs; fairring's own operations are waited for here, before the
  // ranks synchronise, so that past the barrier they are done on every rank.
  // A failure of the group raises here on every rank alike: the engine's
  // barrier takes its turn, and fails wherever the group failed before it.
  if (cpuAllreduce_) {
    cpuAllreduce_->barrier();
  }
  awaitSubgroups();
  return cpu_->barrier(opts);
}

void FairringBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  if (cpuAllreduce_) {
    cpuAllreduce_->barrier();
  }
  awaitSubgroups();
  cpu_->monitoredBarrier(opts, waitAllRanks);
}

void FairringBackend::awaitSubgroups() {
  // The allreduces on the accelerator are done on the device, not only
  // enqueued, past a barrier, as they would be behind NCCL's.
  for (auto* subgroups : {cudaSubgroups_.get(), cpuSubgroups_.get()}) {
    if (subgroups != nullptr) {
      subgroups->awaitIssued();
    }
  }
}

void FairringBackend::setSequenceNumberForGroup() {
  cpu_->setSequenceNumberForGroup();
}

uint64_t FairringBackend::getSequenceNumberForGroup() {
  return cpu_->getSequenceNumberForGroup();
}

void FairringBackend::shutdownCore(bool drain) {
  // A destroy lets the device finish what this rank issued (peers may still
  // need its sends); an abort stops at once.
  for (auto* subgroups : {cudaSubgroups_.get(), cpuSubgroups_.get()}) {
    if (subgroups == nullptr) {
      continue;
    }
    if (drain) {
      subgroups->shutdown();
    } else {
      subgroups->abort();
    }
  }
  if (engine_) {
    engine_->shutdown();
  }
  if (cpuAllreduce_) {
    cpuAllreduce_->shutdown();
  }
}

void FairringBackend::shutdown() {
  WithoutGil released;
  shutdownCore(/*drain=*/true);
  releaseRing();
  cpu_->shutdown();
  if (cuda_) {
    cuda_->shutdown();
  }
}

void FairringBackend::abort() {
  WithoutGil released;
  shutdownCore(/*drain=*/false);
  releaseRing();
  cpu_->abort();
  if (cuda_) {
    cuda_->abort();
  }
}

void FairringBackend::releaseRing() {
  // A ring call the group's failure gave up on may still wait inside Gloo
  // (for a peer that refused it) until Gloo's timeout, and destroying its
  // group joins that thread: the group is left to the process instead, so
  // that destroy takes no longer than fairring's own shutdown.
  if (ring_ && cpuAllreduce_ && cpuAllreduce_->stats().ringAbandoned > 0) {
    (void)ring_.release();
  }
}

} // namespace fairring
