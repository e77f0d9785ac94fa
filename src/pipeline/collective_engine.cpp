// The engine's admission and progress: operations take turns, their slices
// take staging slots in turn order, and each segment runs its kind's steps
// (steps.h). Messages are engine_messages.cpp's, failure engine_failure.cpp's.

#include "pipeline/allreduce_engine.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <set>

#include "faults/fault_points.h"
#include "ops/reduce_kind.h"
#include "pipeline/ordered_completion.h"

namespace fairring {

using Clock = std::chrono::steady_clock;
using RedOp = c10d::ReduceOp::RedOpType;

namespace {

std::mutex gRegistryMu;
std::set<AllreduceEngine*>& registry() {
  static auto* engines = new std::set<AllreduceEngine*>(); // never destroyed: used at exit
  return *engines;
}

// A timeline stamp: free when the timeline is off (one branch, no clock read).
void stamp(const Timeline& timeline, int64_t& at) {
  if (timeline.enabled()) {
    at = Timeline::now();
  }
}

} // namespace

AllreduceEngine::AllreduceEngine(RankLayout layout, EngineOptions options)
    : layout_(std::move(layout)),
      options_(std::move(options)),
      timeline_(options_.timelinePath, layout_.rank()),
      steps_{allreduceSteps(layout_), reduceScatterSteps(layout_), allGatherSteps(layout_), allreduceSteps(layout_)},
      outboxes_(layout_),
      staging_(options_.totalMemory, options_.slotBytes) {
  TORCH_CHECK(
      options_.sliceBytes > 0 && options_.chunkBytes > 0 && options_.timeout.count() > 0,
      "fairring: the engine needs a slice size, a pipeline chunk and a timeout (fairring_pg.config sets them)");
  // The slot's size is fairring_pg.config's rule; its layout is the steps'.
  for (const int64_t elem : {1, 2, 4, 8}) {
    const SlicePlan plan(
        0, static_cast<int64_t>(options_.sliceBytes) / elem, static_cast<int64_t>(options_.chunkBytes) / elem,
        layout_.localSize(), layout_.numMachines());
    TORCH_CHECK(
        plan.stagedBytes(elem) <= static_cast<int64_t>(options_.slotBytes), "fairring: a staging slot of ",
        options_.slotBytes, " bytes cannot hold a slice of ", options_.sliceBytes, " bytes of ", elem,
        "-byte elements (", plan.stagedBytes(elem), " bytes): fairring_pg.config.staging_slot_bytes and the "
        "engine's layout disagree");
  }
  mesh_ = std::make_unique<PeerMesh>(
      layout_,
      PeerMesh::Options{options_.listenAddress, options_.token, options_.timeout},
      [this](int peer, Lane lane, Status status, std::string header, size_t bytes) {
        onMessage(peer, lane, std::move(status), std::move(header), bytes);
      });
  std::lock_guard<std::mutex> lock(gRegistryMu);
  registry().insert(this);
}

AllreduceEngine::~AllreduceEngine() {
  {
    std::lock_guard<std::mutex> lock(gRegistryMu);
    registry().erase(this);
  }
  shutdown();
}

void AllreduceEngine::shutdownAll(std::chrono::milliseconds grace) {
  std::lock_guard<std::mutex> lock(gRegistryMu);
  const auto deadline = Clock::now() + grace;
  for (AllreduceEngine* engine : registry()) {
    std::unique_lock<std::mutex> engineLock(engine->mu_);
    engine->cv_.wait_until(engineLock, deadline, [engine] { return engine->ops_.empty(); });
  }
  for (AllreduceEngine* engine : registry()) {
    engine->shutdown();
  }
  // The shutdowns failed what was left; its futures' callbacks run on the
  // completion threads, which must be done before Python finalizes.
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  OrderedCompletion::stopAll(std::max(left, std::chrono::milliseconds(1000)));
}

void AllreduceEngine::start(c10d::Store& store) {
  const Status status = mesh_->start(store);
  if (!status.ok()) {
    mesh_->close();
    throw c10::DistBackendError(status.message());
  }
  faults::hit(faults::kEngineStart);
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A shutdown meanwhile (interpreter exit, a destroy) joined no watchdog:
    // none may start after it.
    if (stopping_) {
      throw c10::DistBackendError("fairring: the process group was shut down while it was starting");
    }
    // A peer that failed while we were still connecting told us before we
    // could tell the peers we had not reached yet: they hear it now.
    if (auto held = failure_.connected()) {
      sendAborts(*held, actions);
    }
    watchdog_ = std::thread([this] { watchdog(); });
  }
  run(actions);
}

c10::intrusive_ptr<AllreduceEngine::Future> AllreduceEngine::enqueue(
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

c10::intrusive_ptr<AllreduceEngine::Future> AllreduceEngine::barrier() {
  auto future = c10::make_intrusive<Future>(c10::ListType::create(c10::TensorType::get()));
  admit(newOp(OpKind::kBarrier, at::empty({0}, at::kFloat), RedOp::SUM, {}, nullptr, future));
  return future;
}

c10::intrusive_ptr<AllreduceEngine::Future> AllreduceEngine::enqueueSharded(
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
  o->sharded = ShardedPlan(part.numel(), sliceElems, segmentElems);
  admit(std::move(o));
  return future;
}

int64_t AllreduceEngine::shardedSliceElems(
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
    sliceElems = std::min<int64_t>(sliceElems, static_cast<int64_t>(staging_.slotBytes()) / (elem * staged));
    if (sliceElems == 0) {
      refuse(where + ": FAIRRING_SLICE_SIZE=" + std::to_string(options_.sliceBytes) +
             " is too small for a reduce_scatter of " + dtypeName(input.scalar_type()) + " at world size " +
             std::to_string(W));
    }
  }
  return sliceElems;
}

std::unique_ptr<Operation> AllreduceEngine::newOp(
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
    o->plan = SlicePlan(
        o->work.numel(), static_cast<int64_t>(options_.sliceBytes / o->elemSize),
        static_cast<int64_t>(options_.chunkBytes / o->elemSize), layout_.localSize(), layout_.numMachines());
  }
  return o;
}

uint64_t AllreduceEngine::admit(std::unique_ptr<Operation> o) {
  Actions actions;
  std::string refusal;
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Its turn, whatever happens to it: every rank numbers its calls alike.
    seq = o->seq = nextSeq_++;
    if (auto departed = failure_.departed(); departed && !failure_.fails(o->seq)) {
      failLocked(*departed, actions, o->seq);
    }
    // A call before the failed turn runs as if nothing had happened: a slower
    // rank may learn of a failure before it posts what the others still wait for.
    if (failure_.fails(o->seq)) {
      refusal = failure_.refusal();
    } else {
      admitLocked(std::move(o), actions);
    }
  }
  run(actions);
  if (!refusal.empty()) {
    throw c10::DistBackendError(refusal);
  }
  return seq;
}

void AllreduceEngine::refuse(const std::string& message) {
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The turn this operation would have had, and every later one.
    failLocked(message, actions, nextSeq_++);
  }
  run(actions);
  throw c10::DistBackendError(message);
}

c10::intrusive_ptr<AllreduceEngine::Future> AllreduceEngine::announce(
    int64_t numel,
    at::ScalarType dtype,
    RedOp op,
    uint64_t& seq) {
  auto future = c10::make_intrusive<Future>(c10::ListType::create(c10::TensorType::get()));
  auto o = newOp(OpKind::kAllreduce, at::empty({0}, at::TensorOptions().dtype(dtype)), op, {}, nullptr, future);
  o->announcedNumel = numel;
  seq = admit(std::move(o));
  return future;
}

void AllreduceEngine::watchTurn(uint64_t seq, std::function<void(const std::string&)> fail) {
  std::string failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.fails(seq)) {
      outsideTurns_[seq] = std::move(fail);
      return;
    }
    failed = failure_.refusal();
  }
  fail(failed);
}

void AllreduceEngine::turnDone(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  outsideTurns_.erase(seq);
}

std::string AllreduceEngine::turnFailed(uint64_t seq, const std::string& message) {
  Actions actions;
  std::string reason = message;
  {
    std::unique_lock<std::mutex> lock(mu_);
    outsideTurns_.erase(seq);
    // Gloo names a lost peer by its address only. A peer that died closed this
    // rank's own connections to it at the same moment: give their readers the
    // time a failed send gives them to reach that close, and name the rank.
    cv_.wait_for(lock, GroupFailure::kSendFailureWait, [this] {
      return stopping_ || failure_.failed() || failure_.departed().has_value();
    });
    if (auto departed = failure_.departed(); departed && !failure_.failed()) {
      reason = message + "; " + *departed;
    }
    if (!stopping_) {
      failLocked(reason, actions, seq);
    }
  }
  run(actions);
  return reason;
}

void AllreduceEngine::admitLocked(std::unique_ptr<Operation> o, Actions& actions) {
  o->deadline = Clock::now() + options_.timeout;
  stamp(timeline_, o->tEnqueued);
  layOut(*o);
  const KindSteps& steps = stepsOf(*o);
  int64_t segments = 0;
  for (const Slice& slice : o->slices) {
    segments += static_cast<int64_t>(slice.segments.size());
    waitingForSlot_.emplace_back(o->seq, slice.index);
  }
  outboxes_.expect(o->seq, segments * steps.toEachLocalPeer(), segments * steps.toRail());
  ops_[o->seq] = std::move(o);
  pump(actions);
}

void AllreduceEngine::layOut(Operation& op) {
  const KindSteps& steps = stepsOf(op);
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  // An empty tensor still takes one (empty) slice: its headers must travel so
  // that a rank calling with 0 elements where others have more is caught.
  op.slicesLeft = std::max<int64_t>(1, op.sliced() ? op.plan.numSlices() : op.sharded.numSlices());
  op.slices.resize(op.slicesLeft);
  for (int64_t s = 0; s < op.slicesLeft; ++s) {
    Slice& slice = op.slices[s];
    slice.index = s;
    slice.segments.resize(op.sliced() ? op.plan.numSegments(s) : op.sharded.numSegments(s));
    slice.segmentsLeft = slice.segmentsStaged = static_cast<int>(slice.segments.size());
    for (size_t g = 0; g < slice.segments.size(); ++g) {
      Segment& seg = slice.segments[g];
      seg.index = static_cast<int>(g);
      seg.id = nextSegmentId_++;
      for (int phase = 0; phase < kNumPhases; ++phase) {
        const Phase p = static_cast<Phase>(phase);
        const bool intraNode = p == Phase::kReduceScatter || p == Phase::kAllGather;
        seg.announced[phase].assign(static_cast<size_t>((intraNode ? L : M) * steps.piecesPer(p)), 0);
      }
      seg.forwarded.assign(L, 0);
    }
  }
}

void AllreduceEngine::run(Actions& actions) {
  for (auto& a : actions) {
    a();
  }
  actions.clear();
}

void AllreduceEngine::pump(Actions& actions) {
  while (!waitingForSlot_.empty()) {
    auto [seq, s] = waitingForSlot_.front();
    auto it = ops_.find(seq);
    if (it == ops_.end()) {
      waitingForSlot_.pop_front();
      continue;
    }
    Operation& op = *it->second;
    Slice& slice = op.slices[s];
    // A kind that stages nothing still activates in the global order: that
    // is what keeps its messages in order on the reduce lane.
    if (stepsOf(op).staged()) {
      const int slot = staging_.tryAcquire();
      if (slot < 0) {
        return;
      }
      slice.slot = slot;
      slice.staging = staging_.data(slot);
    }
    waitingForSlot_.pop_front();
    activate(op, slice, actions);
  }
}

void AllreduceEngine::activate(Operation& op, Slice& slice, Actions& actions) {
  slice.active = true;
  stamp(timeline_, slice.tActive);
  for (Segment& seg : slice.segments) {
    Turn t{op, slice, seg, *this, actions};
    stepsOf(op).open(t);
  }
  auto parked = parked_.find({op.seq, slice.index});
  if (parked != parked_.end()) {
    std::vector<Parked> waiting = std::move(parked->second);
    parked_.erase(parked);
    for (const Parked& p : waiting) {
      if (failure_.fails(op.seq)) {
        // The operation failed while delivering: drop the rest unread.
        discard(p.peer, laneOf(p.header.phase), p.bytes, actions);
      } else {
        deliver(op, slice, p.peer, p.header, p.bytes, actions);
      }
    }
    if (failure_.fails(op.seq)) {
      return;
    }
  }
  for (Segment& seg : slice.segments) {
    Turn t{op, slice, seg, *this, actions};
    advance(t);
  }
}

void AllreduceEngine::advance(Turn& t) {
  const KindSteps& steps = stepsOf(t.op);
  while (t.slice.active && !t.seg.done && !t.seg.busy) {
    if (t.seg.step >= steps.numSteps()) {
      finishSegment(t);
      return;
    }
    switch (steps.run(t)) {
      case Next::kWait: return;
      case Next::kReducing: t.seg.busy = true; return;
      case Next::kDone:
        stamp(timeline_, t.seg.stepEnded[t.seg.step]);
        ++t.seg.step;
        break;
    }
  }
}

void AllreduceEngine::send(Turn& t, int peer, Phase phase, int piece, uint8_t* data, size_t bytes) {
  const Lane lane = laneOf(phase);
  Outboxes::Message message{
      encode(t.op.header(t.slice.index, t.seg.index, phase, piece)), data, bytes, t.op.seq, t.slice.index,
      t.seg.index, peer};
  switch (outboxes_.queue(lane, std::move(message))) {
    case Outboxes::Queued::kUnannounced:
      failLocked(
          "fairring: internal error: " + std::string(opKindName(t.op.kind)) + " #" + std::to_string(t.op.seq) +
              " sends more reduce-lane messages to " + layout_.describe(peer) + " than it announced",
          t.actions);
      return;
    case Outboxes::Queued::kStartDrainer:
      t.actions.push_back([this, key = outboxes_.keyOf(peer), lane] { drain(key, lane); });
      break;
    case Outboxes::Queued::kQueued: break;
  }
  ++t.seg.sendsInFlight;
}

void AllreduceEngine::drain(int key, Lane lane) {
  for (;;) {
    std::optional<Outboxes::Message> next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      next = outboxes_.next(key, lane, failure_.failSeq(), meshClosed_);
      if (!next) {
        return;
      }
    }
    const uint64_t seq = next->seq;
    const int64_t s = next->slice;
    const int g = next->segment;
    const int peer = next->peer;
    mesh_->send(peer, lane, std::move(next->header), next->data, next->bytes, [this, seq, s, g, peer](Status status) {
      onSent(seq, s, g, peer, std::move(status));
    });
  }
}

void AllreduceEngine::reduce(Turn& t, std::function<void()> task) {
  stamp(timeline_, t.seg.reduceStarted);
  const uint64_t seq = t.op.seq;
  const int64_t s = t.slice.index;
  const int g = t.seg.index;
  tasks_.post([this, seq, s, g, task = std::move(task)] {
    std::string error;
    try {
      faults::hit(faults::kEngineReduce, static_cast<int64_t>(seq));
      task();
    } catch (const std::exception& e) {
      error = e.what();
    }
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = ops_.find(seq);
      if (!error.empty()) {
        // This operation cannot finish here, so nowhere: it fails on every rank.
        failLocked(
            "fairring: a reduction of " + (it != ops_.end() ? std::string(opKindName(it->second->kind)) : "operation") +
                " #" + std::to_string(seq) + " failed on " + layout_.describe(layout_.rank()) + ": " + error,
            actions, seq);
      } else if (it != ops_.end()) {
        Slice& slice = it->second->slices[s];
        Turn t{*it->second, slice, slice.segments[g], *this, actions};
        t.seg.busy = false;
        stamp(timeline_, t.seg.stepEnded[t.seg.step]);
        ++t.seg.step;
        advance(t);
      }
    }
    run(actions);
  });
}

void AllreduceEngine::unstage(Turn& t) {
  if (--t.slice.segmentsStaged > 0 || t.slice.slot < 0) {
    return;
  }
  staging_.release(t.slice.slot);
  t.slice.slot = -1;
  t.slice.staging = nullptr;
  pump(t.actions);
}

void AllreduceEngine::finishSegment(Turn& t) {
  t.seg.done = true;
  recordSegment(t.op, t.slice, t.seg);
  if (--t.slice.segmentsLeft == 0) {
    t.slice.done = true;
    if (--t.op.slicesLeft == 0) {
      finishOperation(t.op, t.actions);
    }
  }
}

void AllreduceEngine::finishOperation(Operation& op, Actions& actions) {
  recordOp(op);
  if (outboxes_.expecting(op.seq)) {
    // It would hold every later operation's messages forever.
    failLocked(
        "fairring: internal error: " + std::string(opKindName(op.kind)) + " #" + std::to_string(op.seq) +
            " finished without sending every reduce-lane message it announced",
        actions, op.seq);
    return;
  }
  auto it = ops_.find(op.seq);
  std::shared_ptr<Operation> finished(std::move(it->second));
  ops_.erase(it);
  cv_.notify_all(); // shutdownAll may be waiting for ops_ to empty
  complete(std::move(finished), actions);
}

void AllreduceEngine::complete(std::shared_ptr<Operation> finished, Actions& actions) {
  actions.push_back([this, finished] {
    auto complete = [finished] {
      try {
        if (finished->finish) {
          finished->finish();
        }
        finished->future->markCompleted(c10::IValue(finished->outputs));
      } catch (const std::exception& e) {
        if (!finished->future->completed()) {
          finished->future->setError(std::make_exception_ptr(
              c10::DistBackendError(std::string("fairring: completing allreduce failed: ") + e.what())));
        }
      }
    };
    // A write-back is arithmetic: the reduction thread's. Without one, the
    // future completes here: its callbacks only hand the result on (to
    // OrderedCompletion), and a hop to another thread would only add latency.
    if (finished->finish) {
      tasks_.post(std::move(complete));
    } else {
      complete();
    }
  });
}

} // namespace fairring
