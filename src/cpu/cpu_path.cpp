#include "cpu/cpu_path.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "cpu/future_work.h"
#include "cpu/ring_reaper.h"
#include "faults/plants.h"
#include "ops/reduce_kind.h"
#include "ops/tensor_fusion.h"
#include "transport/startup_failure.h"

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

// As torch's profiler and Work name the call.
c10d::OpType opTypeOf(AnnouncedCall call) {
  switch (call) {
    case AnnouncedCall::kBroadcast: return c10d::OpType::BROADCAST;
    case AnnouncedCall::kReduce: return c10d::OpType::REDUCE;
    case AnnouncedCall::kGather: return c10d::OpType::GATHER;
    case AnnouncedCall::kScatter: return c10d::OpType::SCATTER;
    case AnnouncedCall::kAllToAll: return c10d::OpType::ALLTOALL;
    case AnnouncedCall::kAllGatherCoalesced: return c10d::OpType::ALLGATHER_COALESCED;
    case AnnouncedCall::kAllreduceSparse:
    case AnnouncedCall::kRingAllreduce: return c10d::OpType::ALLREDUCE;
    case AnnouncedCall::kBlockCall: return c10d::OpType::COALESCED;
  }
  return c10d::OpType::UNKNOWN;
}

const char* profilingTitleOf(AnnouncedCall call) {
  switch (call) {
    case AnnouncedCall::kBroadcast: return "fairring:broadcast";
    case AnnouncedCall::kReduce: return "fairring:reduce";
    case AnnouncedCall::kGather: return "fairring:gather";
    case AnnouncedCall::kScatter: return "fairring:scatter";
    case AnnouncedCall::kAllToAll: return "fairring:all_to_all";
    case AnnouncedCall::kAllGatherCoalesced: return "fairring:all_gather_coalesced";
    case AnnouncedCall::kAllreduceSparse:
    case AnnouncedCall::kRingAllreduce: return "fairring:all_reduce";
    case AnnouncedCall::kBlockCall: return "fairring:coalesced";
  }
  return "fairring:collective";
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
    std::vector<CpuPlanRow> plan,
    std::unique_ptr<MeasuredChoice> measured)
    : gloo_(std::move(gloo)),
      ring_(std::move(ring)),
      plan_(std::move(plan)),
      measured_(std::move(measured)),
      rank_(rank) {
  for (size_t row = 0; row < plan_.size(); ++row) {
    TORCH_CHECK(
        plan_[row].way == CpuWay::kEngine || ring_, "fairring: allreduces on the ring need a ring delegate");
    TORCH_CHECK(
        (plan_[row].way == CpuWay::kMeasured) == (measured_ && measured_->measures(row)),
        "fairring: the CPU plan's measured rows and the measured choice's differ at row ", row);
  }
  engine_ = std::make_unique<CollectiveEngine>(std::move(layout), options);
  engine_->start(store, publishedStartupFailure(store));
  cpuAllreduce_ = std::make_unique<CpuAllreduce>(
      rank, *engine_, options, c10::make_intrusive<c10d::PrefixStore>("callbacks/", store));
  cpuSharded_ = std::make_unique<CpuSharded>(*cpuAllreduce_, size);
  glooCalls_ = std::make_unique<GlooCalls>(*engine_);
}

CpuPath::~CpuPath() {
  glooCalls_.reset();
  cpuSharded_.reset();
  cpuAllreduce_.reset();
  engine_.reset();
}

c10::intrusive_ptr<c10d::Work> CpuPath::delegated(
    const std::vector<at::Tensor>& tensors,
    const Issue& issue,
    Callers callers,
    const std::optional<Announced>& what) {
  if (callers != Callers::kEveryRank || plants::planted(plants::Plant::kDelegatedUnannounced)) {
    return issue(*gloo_); // point-to-point: Gloo pairs it by its tag, not by its order
  }
  if (!what) {
    glooCalls_->awaitHandedOver(); // behind the announced calls before it, as issued
    return issue(*gloo_);
  }
  // Counted while on Gloo, for a timeout's wait chain (engine_blame.cpp).
  // Not a reference to Gloo's group: the call may end on Gloo's thread, where
  // dropping the group's last reference would join that thread. GlooCalls runs
  // it only before its shutdown, which comes before the group's release.
  GlooCalls::Start start = [gloo = gloo_.get(), issue, calls = engine_->delegatedCalls()]() {
    c10::intrusive_ptr<c10d::Work> work = issue(*gloo);
    TORCH_CHECK(work, "fairring: Gloo returned no Work for a collective");
    c10::intrusive_ptr<c10::ivalue::Future> future = work->getFuture();
    const uint64_t id = calls->begin();
    future->addCallback([calls, id](c10::ivalue::Future&) { calls->end(id); });
    return future;
  };
  auto future = CpuAllreduce::issuedFromCallback() ? glooCalls_->issueUnannounced(std::move(start))
                                                   : glooCalls_->issue(std::move(start), *what);
  return c10::make_intrusive<FutureWork>(rank_, opTypeOf(what->call), profilingTitleOf(what->call), tensors, future);
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
  return runChosen(
      work, opts.reduceOp.op_, {tensor}, std::move(finish), c10d::OpType::ALLREDUCE, "fairring:all_reduce", tensors);
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
  return runChosen(
      fusion.fused, opts.reduceOp.op_, tensors, std::move(fusion.scatterBack), c10d::OpType::ALLREDUCE_COALESCED,
      "fairring:all_reduce_coalesced", tensors);
}

CpuPath::Choice CpuPath::choose(const at::Tensor& work, c10d::ReduceOp::RedOpType op) {
  // A call from a callback stays on the callbacks' engine (CpuAllreduce::runOn)
  // and counts for no class: callbacks interleave with the program's calls
  // differently on each rank.
  if (!glooReduces(work.scalar_type(), op) || CpuAllreduce::issuedFromCallback()) {
    return Choice{};
  }
  const size_t bytes = static_cast<size_t>(work.numel()) * work.element_size();
  const size_t row = cpuRowOf(plan_, bytes);
  switch (plan_[row].way) {
    case CpuWay::kEngine:
      return Choice{};
    case CpuWay::kRing:
      return Choice{true, std::nullopt};
    case CpuWay::kMeasured:
      break;
  }
  if (bytes == 0) {
    return Choice{}; // nothing to time
  }
  const MeasuredChoice::Turn turn = measured_->next(row, bytes);
  return Choice{turn.way == 1, turn};
}

c10::intrusive_ptr<c10d::Work> CpuPath::runChosen(
    const at::Tensor& work,
    c10d::ReduceOp::RedOpType op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish,
    c10d::OpType opType,
    const char* profilingTitle,
    const std::vector<at::Tensor>& inputs) {
  const Choice choice = choose(work, op);
  std::shared_ptr<TrialTimer> timer;
  CpuAllreduce::Observe observe;
  if (choice.turn && choice.turn->timed) {
    timer = timers_.start(choice.turn->call, c10::Device(c10::kCPU));
    measured_->keep(*choice.turn, timer);
    observe = [timer](const c10::intrusive_ptr<c10::ivalue::Future>& source) { timer->watch(source); };
  }
  CpuAllreduce::Ring ring = choice.ring ? ringOf(work, op, outputs, finish, timer) : nullptr;
  try {
    return cpuAllreduce_->run(
        work, op, std::move(outputs), std::move(finish), opType, profilingTitle, inputs, ring, observe);
  } catch (const std::exception& e) {
    if (timer) {
      timer->raised(e.what());
    }
    throw;
  }
}

CpuAllreduce::Ring CpuPath::ringOf(
    const at::Tensor& work,
    c10d::ReduceOp::RedOpType op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish,
    std::shared_ptr<TrialTimer> timer) {
  const int64_t bytes = work.numel() * static_cast<int64_t>(work.element_size());
  return [this, work, op, bytes, outputs = std::move(outputs), finish = std::move(finish), timer]() {
    if (timer) {
      timer->began(); // a trial of the ring is timed from its hand-over, as the program's own call would be
    }
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
            " bytes on Gloo's ring (FAIRRING_CPU_ALLREDUCE) failed: " +
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
  // Their announcements have ended: the barrier Gloo runs next is behind
  // every collective handed to it before, on every rank.
  if (!plants::planted(plants::Plant::kBarrierBeforeHandOver)) {
    glooCalls_->awaitHandedOver();
  }
}

void CpuPath::stop(bool drain) {
  if (measured_) {
    measured_->stop();
  }
  engine_->shutdown();
  cpuAllreduce_->shutdown();
  glooCalls_->shutdown(); // after the engine's: what it failed has been told
  // A ring call the group's failure gave up on may still wait inside Gloo
  // (for a peer that refused it) until Gloo's timeout, and destroying its
  // group joins that thread: it is freed once Gloo gives up too, so that
  // destroy takes no longer than fairring's own shutdown.
  if (ring_ && cpuAllreduce_->stats().ringAbandoned > 0) {
    if (plants::planted(plants::Plant::kRingLeftToProcess)) {
      (void)ring_.release();
      return;
    }
    ring_reaper::freeWhenIdle(std::move(ring_), cpuAllreduce_->ringsInGloo());
  }
}

} // namespace fairring
