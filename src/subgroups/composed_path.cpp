#include "subgroups/composed_path.h"

#include <c10/util/Exception.h>

#include "faults/plants.h"
#include "ops/reduce_kind.h"
#include "subgroups/capture_probe.h"

namespace fairring {

ComposedPath::ComposedPath(
    std::unique_ptr<SubgroupAllreduce> composition,
    c10::intrusive_ptr<c10d::Backend> delegate,
    std::unique_ptr<MeasuredChoice> measured,
    StreamMaker ownStream)
    : composition_(std::move(composition)),
      delegate_(std::move(delegate)),
      measured_(std::move(measured)),
      timers_(std::move(ownStream)) {
  TORCH_CHECK(composition_ && delegate_, "fairring: a composed path needs its composition and a delegate");
}

bool ComposedPath::delegateTakes(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    // ProcessGroupNCCL's checks (check_gpu_single_tensor: "Tensors must be
    // contiguous"; getNcclDataType: no 16-bit integers), which the stand-in copies.
    if (!t.is_contiguous(t.suggest_memory_format()) || t.scalar_type() == at::kShort) {
      return false;
    }
  }
  return true;
}

ComposedPath::Route ComposedPath::routeOf(const std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op) {
  Route route;
  if (tensors.empty()) {
    return route;
  }
  const at::Tensor& first = tensors.front();
  int64_t numel = 0;
  for (const at::Tensor& t : tensors) {
    // What the composition does not take, the delegate runs or refuses, as it would under its own name.
    if (!t.defined() || t.layout() != at::kStrided || t.device() != first.device() ||
        t.scalar_type() != first.scalar_type()) {
      return route;
    }
    numel += t.numel();
  }
  const CallCut cut = composition_->cutFor(numel, first.scalar_type());
  route.row = cut.row;
  if (!checkReducible(op, first.scalar_type()).ok()) {
    return route;
  }
  route.byPlan = cut.units.empty() || cut.units.front().direct;
  // A captured call is replayed later, on every rank that captured it (as the
  // program does on every rank): the delegate's own allreduce, which a CUDA
  // graph can hold, and fairring's streams cannot.
  route.compose = !route.byPlan && !isCapturing(currentStreamCapture(first.device()));
  // A call only the composition takes (a view, int16: NCCL refuses them) is
  // no trial: it would raise on the delegate's turns, and a trial that raises
  // fails its class. It composes, untimed, on every rank alike (the call's
  // layout and dtype are the program's).
  const bool bothWays = plants::planted(plants::Plant::kTrialsOnOneWayCalls) || delegateTakes(tensors);
  if (route.compose && bothWays && measured_ && measured_->measures(cut.row)) {
    // Every rank counts the same calls here: the program's own (on CUDA every
    // collective is issued from the calling thread in program order), of a
    // dtype and op both ways reduce, not captured (every rank of a program
    // captures the same calls).
    route.turn = measured_->next(cut.row, cut.bytes);
    route.compose = route.turn->way == 1;
  }
  return route;
}

c10::intrusive_ptr<c10d::Work> ComposedPath::timed(
    const Route& route,
    c10::Device device,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) {
  if (!route.turn || !route.turn->timed) {
    return issue();
  }
  std::shared_ptr<TrialTimer> timer = timers_.start(route.turn->call, device);
  measured_->keep(*route.turn, timer);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = issue();
  } catch (const std::exception& e) {
    timer->raised(e.what());
    throw;
  }
  timer->watch(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> ComposedPath::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  const auto op = opts.reduceOp.op_;
  const Route route = routeOf(tensors, op);
  return timed(route, tensors.front().device(), [&]() {
    if (route.compose) {
      return composition_->allreduce(tensors.front(), op);
    }
    if (route.byPlan && plants::planted(plants::Plant::kDirectThroughOurStreams) && tensors.front().numel() > 0) {
      return composition_->allreduceOnOurStreams(tensors.front(), op);
    }
    composition_->countDelegated(route.row);
    return delegated(tensors, [&](c10d::Backend& b) { return b.allreduce(tensors, opts); }, Callers::kEveryRank, std::nullopt);
  });
}

c10::intrusive_ptr<c10d::Work> ComposedPath::allreduceCoalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  const auto op = opts.reduceOp.op_;
  const Route route = routeOf(tensors, op);
  return timed(route, tensors.front().device(), [&]() {
    if (route.compose) {
      return composition_->allreduceCoalesced(tensors, op);
    }
    composition_->countDelegated(route.row);
    return delegated(tensors, [&](c10d::Backend& b) { return b.allreduce_coalesced(tensors, opts); }, Callers::kEveryRank, std::nullopt);
  });
}

c10::intrusive_ptr<c10d::Work> ComposedPath::delegated(
    const std::vector<at::Tensor>& tensors,
    const Issue& issue,
    Callers callers,
    const std::optional<Announced>& /*what*/) {
  composition_->orderBefore(tensors);
  barrier_.used(callers);
  c10::intrusive_ptr<c10d::Work> work = issue(*delegate_);
  if (work) {
    composition_->orderAfter(tensors, work);
  }
  return work;
}

void ComposedPath::awaitIssued(const c10d::BarrierOptions& opts) {
  composition_->awaitIssued();
  barrier_.await(delegate_, opts);
}

void ComposedPath::stop(bool drain) {
  if (measured_) {
    measured_->stop();
  }
  if (drain) {
    composition_->shutdown();
  } else {
    composition_->abort();
  }
}

} // namespace fairring
