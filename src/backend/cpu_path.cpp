#include "backend/cpu_path.h"

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
      t.device().is_cpu(), "fairring: ", name, " is on device ", t.device(), "; expected a CPU or CUDA tensor");
}

} // namespace

CpuPath::CpuPath(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    RankLayout layout,
    const EngineOptions& options,
    c10::intrusive_ptr<c10d::Backend> gloo,
    c10::intrusive_ptr<c10d::Backend> ring,
    int64_t ringFrom)
    : gloo_(std::move(gloo)), ring_(std::move(ring)), ringFrom_(ringFrom) {
  TORCH_CHECK(ringFrom_ < 0 || ring_, "fairring: allreduces on the ring need a ring delegate");
  engine_ = std::make_unique<AllreduceEngine>(std::move(layout), options);
  engine_->start(*store);
  cpuAllreduce_ = std::make_unique<CpuAllreduce>(
      rank, *engine_, options, c10::make_intrusive<c10d::PrefixStore>("callbacks/", store));
  cpuSharded_ = std::make_unique<CpuSharded>(*cpuAllreduce_, size);
}

CpuPath::~CpuPath() {
  cpuSharded_.reset();
  cpuAllreduce_.reset();
  engine_.reset();
}

c10::intrusive_ptr<c10d::Work> CpuPath::delegated(const std::vector<at::Tensor>& tensors, const Issue& issue) {
  return issue(*gloo_);
}

c10::intrusive_ptr<c10d::Work> CpuPath::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  at::Tensor& tensor = tensors[0];
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

c10::intrusive_ptr<c10d::Work> CpuPath::allreduceCoalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
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

CpuAllreduce::Ring CpuPath::ringFor(
    const at::Tensor& work,
    c10d::ReduceOp::RedOpType op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish) {
  // Decided from what every rank shares (size, dtype, op, the job's shape), so
  // that every rank sends the same allreduce the same way.
  const int64_t bytes = work.numel() * static_cast<int64_t>(work.element_size());
  if (ringFrom_ < 0 || bytes < ringFrom_ || !glooReduces(work.scalar_type(), op)) {
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

c10::intrusive_ptr<c10d::Work> CpuPath::reduceScatterBase(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return cpuSharded_->reduceScatterBase(output, input, opts.reduceOp.op_);
}

c10::intrusive_ptr<c10d::Work> CpuPath::reduceScatterList(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return cpuSharded_->reduceScatterList(outputs, inputs, opts.reduceOp.op_);
}

c10::intrusive_ptr<c10d::Work> CpuPath::reduceScatterCoalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return cpuSharded_->reduceScatterCoalesced(outputs, inputs, opts.reduceOp.op_);
}

c10::intrusive_ptr<c10d::Work> CpuPath::allGatherBase(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return cpuSharded_->allGatherBase(output, input);
}

c10::intrusive_ptr<c10d::Work> CpuPath::allGatherList(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return cpuSharded_->allGatherList(outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> CpuPath::allGatherCoalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return cpuSharded_->allGatherCoalesced(outputs, inputs);
}

void CpuPath::awaitIssued(const c10d::BarrierOptions& opts) {
  cpuAllreduce_->barrier();
}

void CpuPath::stop(bool drain) {
  engine_->shutdown();
  cpuAllreduce_->shutdown();
  // A ring call the group's failure gave up on may still wait inside Gloo
  // (for a peer that refused it) until Gloo's timeout, and destroying its
  // group joins that thread: the group is left to the process instead, so
  // that destroy takes no longer than fairring's own shutdown.
  if (ring_ && cpuAllreduce_->stats().ringAbandoned > 0) {
    (void)ring_.release();
  }
}

} // namespace fairring
