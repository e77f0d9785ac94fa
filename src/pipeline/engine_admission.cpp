// Admission: each call is checked, cut into slices and segments, and takes
// the next turn (the same on every rank), or is refused with the group's
// failure. Calls run on Gloo's ring take their turn here too.

#include <c10/util/Exception.h>

#include <algorithm>

#include "ops/reduce_kind.h"
#include "pipeline/collective_engine.h"

namespace fairring {

using Clock = std::chrono::steady_clock;
using RedOp = c10d::ReduceOp::RedOpType;

c10::intrusive_ptr<CollectiveEngine::Future> CollectiveEngine::enqueue(
    at::Tensor work,
    RedOp op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish) {
  const Status reducible = checkReducible(op, work.scalar_type());
  if (!reducible.ok()) {
    throw c10::DistBackendError(reducible.message());
  }
  auto future = c10::make_intrusive<Future>(c10::ListType::create(c10::TensorType::get()));
  auto o = newOp(OpKind::kAllreduce, work.view({-1}), op, std::move(outputs), std::move(finish), future);
  admit(std::move(o));
  return future;
}

c10::intrusive_ptr<CollectiveEngine::Future> CollectiveEngine::barrier() {
  auto future = c10::make_intrusive<Future>(c10::ListType::create(c10::TensorType::get()));
  admit(newOp(OpKind::kBarrier, at::empty({0}, at::kFloat), RedOp::SUM, {}, nullptr, future));
  return future;
}

c10::intrusive_ptr<CollectiveEngine::Future> CollectiveEngine::enqueueSharded(
    OpKind kind,
    at::Tensor input,
    at::Tensor output,
    RedOp op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish) {
  const int W = layout_.worldSize();
  const std::string where = std::string("fairring: ") + opKindName(kind) + " on " + layout_.describe(layout_.rank());
  if (kind == OpKind::kReduceScatter) {
    const Status reducible = checkReducible(op, input.scalar_type());
    if (!reducible.ok()) {
      throw c10::DistBackendError(reducible.message());
    }
  } else {
    op = RedOp::SUM; // not used; equal on every rank for the header check
  }
  if (input.scalar_type() != output.scalar_type()) {
    refuse(where + ": the input has dtype " + dtypeName(input.scalar_type()) + " but the output has " +
           dtypeName(output.scalar_type()));
  }
  const bool scatter = kind == OpKind::kReduceScatter;
  const at::Tensor& big = scatter ? input : output;
  const at::Tensor& part = scatter ? output : input;
  if (big.numel() != part.numel() * W) {
    refuse(where + ": the " + (scatter ? "input" : "output") + " has " + std::to_string(big.numel()) +
           " elements, expected the world size (" + std::to_string(W) + ") x the " + (scatter ? "output" : "input") +
           "'s " + std::to_string(part.numel()) + " = " + std::to_string(part.numel() * W));
  }
  const int64_t sliceElems = shardedSliceElems(kind, input, part.numel(), where);
  // Each local rank moves about FAIRRING_PIPELINE_CHUNK per segment in the
  // intra-node step (M parts); one machine has no link to overlap.
  const int M = layout_.numMachines();
  const int64_t elem = static_cast<int64_t>(part.element_size());
  const int64_t segmentElems =
      M > 1 ? std::max<int64_t>(1, static_cast<int64_t>(options_.chunkBytes) / elem / M) : sliceElems;
  auto future = c10::make_intrusive<Future>(c10::ListType::create(c10::TensorType::get()));
  auto o = newOp(kind, output.view({-1}), op, std::move(outputs), std::move(finish), future);
  o->input = input.view({-1});
  o->sharded = ShardedCuts(part.numel(), sliceElems, segmentElems);
  admit(std::move(o));
  return future;
}

int64_t CollectiveEngine::shardedSliceElems(
    OpKind kind,
    const at::Tensor& input,
    int64_t partElems,
    const std::string& where) {
  const int W = layout_.worldSize();
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  const int64_t elem = static_cast<int64_t>(input.element_size());
  int64_t sliceElems = std::max<int64_t>(1, static_cast<int64_t>(options_.sliceBytes) / elem / W);
  // A reduce-scatter slice of k elements per part stages (L-1)·M + M-1
  // pieces of k: k = slice / W fits the slot an allreduce slice uses.
  const int64_t staged = static_cast<int64_t>(L - 1) * M + (M - 1);
  if (kind == OpKind::kReduceScatter && staged > 0) {
    sliceElems = std::min<int64_t>(sliceElems, static_cast<int64_t>(ledger_.slotBytes()) / (elem * staged));
    if (sliceElems == 0) {
      refuse(where + ": FAIRRING_SLICE_SIZE=" + std::to_string(options_.sliceBytes) +
             " is too small for a reduce_scatter of " + dtypeName(input.scalar_type()) + " at world size " +
             std::to_string(W));
    }
  }
  return sliceElems;
}

std::unique_ptr<Operation> CollectiveEngine::newOp(
    OpKind kind,
    at::Tensor work,
    RedOp op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish,
    const c10::intrusive_ptr<Future>& future) {
  auto o = std::make_unique<Operation>();
  o->kind = kind;
  o->work = std::move(work);
  o->op = op;
  o->elemSize = o->work.element_size();
  o->future = future;
  o->outputs = std::move(outputs);
  o->finish = std::move(finish);
  if (o->sliced()) {
    o->cuts = SliceCuts(
        o->work.numel(), static_cast<int64_t>(options_.sliceBytes / o->elemSize),
        static_cast<int64_t>(options_.chunkBytes / o->elemSize), layout_.localSize(), layout_.numMachines());
  }
  return o;
}

uint64_t CollectiveEngine::admit(std::unique_ptr<Operation> o) {
  std::string refusal;
  std::unique_lock<std::mutex> lock(mu_);
  Locked locked(lock);
  // Its turn, whatever happens to it: every rank numbers its calls alike.
  const uint64_t seq = o->seq = ledger_.take(locked);
  if (auto departed = failure_.departed(); departed && !failure_.fails(seq)) {
    failLocked(*departed, locked, seq);
  }
  // A call before the failed turn runs as if nothing had happened: a slower
  // rank may learn of a failure before it posts what the others still wait for.
  if (failure_.fails(seq)) {
    refusal = failure_.refusal();
  } else {
    admitLocked(std::move(o), locked);
  }
  locked.release();
  if (!refusal.empty()) {
    throw c10::DistBackendError(refusal);
  }
  return seq;
}

void CollectiveEngine::refuse(const std::string& message) {
  std::unique_lock<std::mutex> lock(mu_);
  Locked locked(lock);
  // The turn this operation would have had, and every later one.
  failLocked(message, locked, ledger_.take(locked));
  locked.release();
  throw c10::DistBackendError(message);
}

c10::intrusive_ptr<CollectiveEngine::Future> CollectiveEngine::announce(const Announced& what, uint64_t& seq) {
  auto future = c10::make_intrusive<Future>(c10::ListType::create(c10::TensorType::get()));
  auto o = newOp(OpKind::kAnnounce, at::empty({0}, at::TensorOptions().dtype(what.dtype)), what.op, {}, nullptr, future);
  o->announced = what;
  seq = admit(std::move(o));
  return future;
}

void CollectiveEngine::watchTurn(uint64_t seq, std::function<void(const std::string&)> fail) {
  std::string failed;
  {
    std::unique_lock<std::mutex> lock(mu_);
    Locked locked(lock);
    if (!failure_.fails(seq)) {
      outside_.watch(seq, std::move(fail), locked);
      return;
    }
    failed = failure_.refusal();
  }
  fail(failed);
}

void CollectiveEngine::turnDone(uint64_t seq) {
  std::unique_lock<std::mutex> lock(mu_);
  outside_.done(seq, Locked(lock));
}

std::string CollectiveEngine::turnFailed(uint64_t seq, const std::string& message) {
  std::string reason = message;
  {
    std::unique_lock<std::mutex> lock(mu_);
    Locked locked(lock);
    outside_.done(seq, locked);
    // Gloo names a lost peer by its address only. A peer that died closed this
    // rank's own connections to it at the same moment: give their readers the
    // time a failed send gives them to reach that close, and name the rank.
    cv_.wait_for(lock, GroupFailure::kSendFailureWait, [this] {
      return life_.is(EngineLife::kShutDown) || failure_.failed() || failure_.departed().has_value();
    });
    if (failure_.failed()) {
      // Another rank's abort came first: its reason names the lost rank.
      reason = message + "; " + failure_.reason();
    } else if (auto departed = failure_.departed()) {
      reason = message + "; " + *departed;
    }
    if (!life_.is(EngineLife::kShutDown)) {
      failLocked(reason, locked, seq);
    }
    locked.release();
  }
  return reason;
}

void CollectiveEngine::admitLocked(std::unique_ptr<Operation> o, Locked& locked) {
  o->deadline = Clock::now() + options_.timeout;
  timeline_.stamp(o->tEnqueued);
  layOut(*o);
  const KindSteps& steps = stepsOf(*o);
  int64_t segments = 0;
  const bool inOrder = steps.activatesInOrder();
  for (const Slice& slice : o->slices) {
    segments += static_cast<int64_t>(slice.segments.size());
  }
  outboxes_.expect(o->seq, segments * steps.toEachLocalPeer(), segments * steps.toRail());
  Operation& op = ledger_.add(std::move(o), inOrder, locked);
  if (!inOrder) {
    // Nothing on the reduce track and nothing staged: it starts now, not
    // behind the slices of earlier operations that wait for a slot.
    for (Slice& slice : op.slices) {
      activate(op, slice, SliceState::kActive, locked);
    }
  }
  pump(locked);
}

void CollectiveEngine::layOut(Operation& op) {
  const KindSteps& steps = stepsOf(op);
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  // An empty tensor still takes one (empty) slice: its headers must travel so
  // that a rank calling with 0 elements where others have more is caught.
  op.slicesLeft = std::max<int64_t>(1, op.sliced() ? op.cuts.numSlices() : op.sharded.numSlices());
  op.slices.resize(op.slicesLeft);
  for (int64_t s = 0; s < op.slicesLeft; ++s) {
    Slice& slice = op.slices[s];
    slice.index = s;
    slice.segments.resize(op.sliced() ? op.cuts.numSegments(s) : op.sharded.numSegments(s));
    slice.segmentsLeft = slice.segmentsStaged = static_cast<int>(slice.segments.size());
    for (size_t g = 0; g < slice.segments.size(); ++g) {
      Segment& seg = slice.segments[g];
      seg.index = static_cast<int>(g);
      seg.id = nextSegmentId_++;
      for (int route = 0; route < kNumRoutes; ++route) {
        const Route p = static_cast<Route>(route);
        const bool intraNode = withinMachine(p);
        seg.announced[route].assign(static_cast<size_t>((intraNode ? L : M) * steps.piecesPer(p)), 0);
      }
      seg.forwarded.assign(L, 0);
    }
  }
}

} // namespace fairring
