#include "cpu/cpu_allreduce.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "cpu/future_work.h"
#include "cpu/python_callback.h"
#include "faults/plants.h"

namespace fairring {

namespace {

// Callbacks run at destroy_process_group (with the errors of what was in
// flight) get this long before their threads are left to finish alone.
constexpr std::chrono::milliseconds kStopGrace{2000};

// trace.rank3.json -> trace.rank3.callbacks.json: the second engine's own file.
std::string callbackTimelinePath(const std::string& path) {
  if (path.empty()) {
    return path;
  }
  const size_t slash = path.find_last_of('/');
  const size_t dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) {
    return path + ".callbacks";
  }
  return path.substr(0, dot) + ".callbacks" + path.substr(dot);
}

c10::intrusive_ptr<c10::ivalue::Future> tensorListFuture() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

} // namespace

CpuAllreduce::CpuAllreduce(
    int rank,
    CollectiveEngine& engine,
    EngineOptions callbackOptions,
    c10::intrusive_ptr<c10d::Store> store)
    : rank_(rank), engine_(engine), callbackOptions_([&] {
        callbackOptions.timelinePath = callbackTimelinePath(callbackOptions.timelinePath);
        callbackOptions.startTimeout = {}; // it starts later, with the whole timeout
        return std::move(callbackOptions);
      }()),
      store_(std::move(store)),
      completion_(callbackOptions_.timeout),
      rings_(engine) {}

CpuAllreduce::~CpuAllreduce() {
  shutdown();
}

c10::intrusive_ptr<c10d::Work> CpuAllreduce::run(
    at::Tensor work,
    c10d::ReduceOp::RedOpType op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish,
    c10d::OpType opType,
    const char* profilingTitle,
    const std::vector<at::Tensor>& inputs,
    const Ring& ring,
    const Observe& observe) {
  const Announced call{AnnouncedCall::kRingAllreduce, work.numel(), work.scalar_type(), op};
  return runOn(
      [&](CollectiveEngine& engine) {
        return engine.enqueue(std::move(work), op, std::move(outputs), std::move(finish));
      },
      opType, profilingTitle, inputs, ring, call, observe);
}

bool CpuAllreduce::issuedFromCallback() {
  return OrderedCompletion::onWorkerThread() || insidePythonFutureCallback();
}

c10::intrusive_ptr<c10d::Work> CpuAllreduce::runOn(
    const Post& post,
    c10d::OpType opType,
    const char* profilingTitle,
    const std::vector<at::Tensor>& inputs,
    const Ring& ring,
    const Announced& ringCall,
    const Observe& observe) {
  bool fromCallback = OrderedCompletion::onWorkerThread();
  if (!fromCallback && insidePythonFutureCallback()) {
    // A callback run inline by then() on a future that was already complete:
    // on another rank the same callback may have run on a worker, so it takes
    // the same pipeline, in the same turn.
    fromCallback = true;
    completion_.awaitMarkedCallbacks();
  }
  if (fromCallback) {
    refuseIfFailed();
  } else {
    refuseIfCallbacksFailed();
  }
  const bool onRing = ring && !fromCallback;
  auto source = onRing ? rings_.issue(ring, ringCall)
                        : post(fromCallback ? callbackEngine() : engine_);
  if (observe) {
    observe(source);
  }
  if (opType != c10d::OpType::BARRIER) {
    ++(onRing ? ringOps_ : engineOps_);
  }
  auto user = tensorListFuture();
  adoptFuture(user);
  // Before the gate that chain() adds: Work.wait() and the profiler range end
  // when the future is marked, not when its turn to run callbacks comes.
  auto result = c10::make_intrusive<FutureWork>(rank_, opType, profilingTitle, inputs, user);
  if (!fromCallback) {
    completion_.chain(source, user);
    return result;
  }
  // Inside a callback: done before returning, so that callbacks chained on
  // it run right here, in this callback's order (as on NCCL, whose futures
  // complete at enqueue).
  source->wait();
  if (source->hasError()) {
    user->setError(source->exception_ptr());
  } else {
    user->markCompleted(source->value());
  }
  return result;
}

std::optional<std::string> CpuAllreduce::lostPeerOrFailure() const {
  if (engine_.failure().failed()) {
    return engine_.failure().refusal();
  }
  if (plants::planted(plants::Plant::kCallbacksStartIgnoresLoss)) {
    return std::nullopt;
  }
  return engine_.failure().departed();
}

void CpuAllreduce::refuseIfFailed() {
  const std::optional<std::string> lost = lostPeerOrFailure();
  if (!lost) {
    return;
  }
  // The group has failed (or lost a peer: its program's next call raises), so
  // do collectives from callbacks, with the same reason. The callbacks' engine
  // fails from this call's turn on and tells its peers, whose same call would
  // otherwise wait for this rank, then report its close at destroy instead
  // (chaos seed 0).
  const std::string refusal = *lost;
  std::shared_ptr<CollectiveEngine> engine;
  {
    std::lock_guard<std::mutex> lock(mu_);
    engine = callbackEngine_;
  }
  if (engine) {
    engine->refuse(refusal);
  }
  throw c10::DistBackendError(refusal);
}

void CpuAllreduce::refuseIfCallbacksFailed() {
  std::shared_ptr<CollectiveEngine> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    callbacks = callbackEngine_;
  }
  if (!callbacks || !callbacks->failure().failed() || plants::planted(plants::Plant::kCallbacksFailureStaysThere)) {
    return;
  }
  // One group, one failure: what broke under a callback's collective (a peer's
  // connection, a reduction) fails the program's calls too, from this turn on,
  // on every rank (the refusal travels to the peers as any failure does).
  engine_.refuse(callbacks->failure().refusal());
}

CpuAllreduce::Stats CpuAllreduce::stats() const {
  return Stats{engineOps_.load(), ringOps_.load(), rings_.abandoned(), rings_.inGloo()->load()};
}

void CpuAllreduce::barrier() {
  auto work = runOn(
      [](CollectiveEngine& engine) { return engine.barrier(); }, c10d::OpType::BARRIER, "fairring:barrier", {});
  // Marked after every earlier operation's future: bounded, since each fails
  // at the group's timeout if it cannot finish.
  work->wait();
}

CollectiveEngine& CpuAllreduce::callbackEngine() {
  std::shared_ptr<CollectiveEngine> engine;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Another callback may be starting it: wait for that, holding nothing.
    started_.wait(lock, [&] { return starting_ == nullptr || stopped_; });
    TORCH_CHECK(!stopped_, "fairring: the process group was shut down");
    if (!startFailure_.empty()) {
      throw c10::DistBackendError(startFailure_);
    }
    if (callbackEngine_) {
      return *callbackEngine_;
    }
    engine = std::make_shared<CollectiveEngine>(engine_.layout(), callbackOptions_);
    starting_ = engine;
  }
  // Every rank starts it at its first allreduce from a callback, up to the
  // group's timeout; one that never gets there (its program differs) leaves
  // the others here, and a shutdown meanwhile interrupts it.
  std::string error;
  try {
    // A peer this group lost will never connect: the wait ends when the
    // program's engine learns it, not at the timeout.
    engine->start(store_, [this] { return lostPeerOrFailure(); });
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard<std::mutex> lock(mu_);
  starting_ = nullptr;
  started_.notify_all();
  if (!error.empty()) {
    startFailure_ = std::string("fairring: starting the pipeline for allreduces issued from callbacks failed on ") +
        engine_.layout().describe(engine_.layout().rank()) + ": " + error;
    throw c10::DistBackendError(startFailure_);
  }
  TORCH_CHECK(!stopped_, "fairring: the process group was shut down");
  callbackEngine_ = std::move(engine);
  return *callbackEngine_;
}

void CpuAllreduce::shutdown() {
  std::shared_ptr<CollectiveEngine> engine;
  std::shared_ptr<CollectiveEngine> starting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) {
      return;
    }
    stopped_ = true;
    engine = callbackEngine_;
    starting = starting_;
    started_.notify_all();
  }
  for (const auto& e : {engine, starting}) {
    if (e) {
      e->shutdown();
    }
  }
  rings_.shutdown(); // after the main engine's: what it failed has been told
  completion_.stop(kStopGrace);
}

} // namespace fairring
