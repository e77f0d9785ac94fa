#include "pipeline/allreduce_engine.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <set>

#include "ops/reduce_kind.h"
#include "pipeline/engine_state.h"
#include "pipeline/ordered_completion.h"

namespace fairring {

using Clock = std::chrono::steady_clock;
using RedOp = c10d::ReduceOp::RedOpType;

namespace {
// How long a failed rank keeps its connections open for its aborts to go out, when a
// peer does not take them.
constexpr auto kAbortGrace = std::chrono::seconds(2);
// How long a close from a peer waits for the reason to arrive from another (see
// closedBeforeReason_); the watchdog looks every 100 ms.
constexpr auto kCloseGrace = std::chrono::milliseconds(300);

std::mutex gRegistryMu;
std::set<AllreduceEngine*>& registry() {
  static auto* engines = new std::set<AllreduceEngine*>(); // never destroyed: used at exit
  return *engines;
}

std::exception_ptr makeError(const std::string& message) {
  return std::make_exception_ptr(c10::DistBackendError(message));
}
} // namespace

AllreduceEngine::AllreduceEngine(RankLayout layout, EngineOptions options)
    : layout_(std::move(layout)),
      options_(std::move(options)),
      timeline_(options_.timelinePath, layout_.rank()),
      staging_(
          options_.totalMemory,
          stagingSlotBytes(options_.sliceBytes, layout_.localSize(), layout_.numMachines())) {
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
  std::lock_guard<std::mutex> lock(gRegistryMu);
  registry().erase(this);
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
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    meshStarted_ = true;
    // A peer that failed while we were still connecting told us before we could
    // tell the peers we had not reached yet: they hear it now.
    if (!failure_.empty() && !stopping_) {
      queueAbortsLocked(failure_, failSeq_, actions);
    }
  }
  run(actions);
  watchdog_ = std::thread([this] { watchdog(); });
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
  o->plan = SlicePlan(
      work.numel(), static_cast<int64_t>(options_.sliceBytes / o->elemSize),
      static_cast<int64_t>(options_.chunkBytes / o->elemSize), layout_.localSize(), layout_.numMachines());
  admit(std::move(o));
  return future;
}

std::unique_ptr<AllreduceEngine::Op> AllreduceEngine::newOp(
    OpKind kind,
    at::Tensor work,
    RedOp op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish,
    const c10::intrusive_ptr<Future>& future) {
  auto o = std::make_unique<Op>();
  o->kind = kind;
  o->work = std::move(work);
  o->op = op;
  o->elemSize = o->work.element_size();
  o->future = future;
  o->outputs = std::move(outputs);
  o->finish = std::move(finish);
  return o;
}

void AllreduceEngine::admit(std::unique_ptr<Op> o) {
  Actions actions;
  std::string refusal;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.empty() && !departed_.empty()) {
      failLocked(departed_, actions);
    }
    refusal = failure_;
    if (refusal.empty()) {
      admitLocked(std::move(o), actions);
    }
  }
  run(actions);
  if (!refusal.empty()) {
    throw c10::DistBackendError(refusal + " (this process group failed earlier and cannot be used)");
  }
}

void AllreduceEngine::refuse(const std::string& message) {
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The turn this operation would have had, and every later one.
    failLocked(message, actions, nextSeq_);
  }
  run(actions);
  throw c10::DistBackendError(message);
}

void AllreduceEngine::admitLocked(std::unique_ptr<Op> o, Actions& actions) {
  o->seq = nextSeq_++;
  o->deadline = Clock::now() + options_.timeout;
  const bool allreduce = o->isAllreduce();
  // An empty tensor still takes one (empty) slice: its headers must travel so
  // that a rank calling with 0 elements where others have more is caught.
  o->slicesLeft = std::max<int64_t>(1, allreduce ? o->plan.numSlices() : o->sharded.numSlices());
  stamp(timeline_, o->tEnqueued);
  o->slices.resize(o->slicesLeft);
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  for (int64_t s = 0; s < o->slicesLeft; ++s) {
    Slice& slice = o->slices[s];
    slice.index = s;
    slice.segments.resize(allreduce ? o->plan.numSegments(s) : o->sharded.numSegments(s));
    slice.segmentsLeft = slice.segmentsStaged = static_cast<int>(slice.segments.size());
    for (size_t g = 0; g < slice.segments.size(); ++g) {
      Segment& seg = slice.segments[g];
      seg.index = static_cast<int>(g);
      seg.id = nextSegmentId_++;
      for (int phase = 0; phase < kNumPhases; ++phase) {
        const Phase p = static_cast<Phase>(phase);
        const bool intraNode = p == Phase::kReduceScatter || p == Phase::kAllGather;
        const bool used = allreduce || p == Phase::kReduceScatter || p == Phase::kCollect ||
            (p == Phase::kAllGather && o->kind == OpKind::kAllGather);
        if (used) {
          seg.announced[phase].assign(static_cast<size_t>((intraNode ? L : M) * piecesPer(*o, p)), 0);
        }
      }
      if (o->kind == OpKind::kAllGather) {
        seg.forwarded.assign(L, 0);
      }
    }
    waitingForSlot_.emplace_back(o->seq, s);
  }
  expectSends(*o);
  ops_[o->seq] = std::move(o);
  pump(actions);
}

void AllreduceEngine::expectSends(const Op& op) {
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  int64_t segments = 0;
  for (const Slice& slice : op.slices) {
    segments += static_cast<int64_t>(slice.segments.size());
  }
  // Per segment, to each local peer: an allreduce's chunk, a reduce-scatter's
  // M parts of that peer's rail, an all-gather's "ready"; to the rail: the
  // collect (or partial sum, or part) for each other machine.
  const int64_t perLocalPeer = op.kind == OpKind::kReduceScatter ? M : 1;
  for (int k = 1; k < L; ++k) {
    sendOrder_.expect(op.seq, layout_.rankOf(layout_.machine(), (layout_.localRank() + k) % L), segments * perLocalPeer);
  }
  if (M > 1) {
    sendOrder_.expect(op.seq, kRailPeers, segments * (M - 1));
  }
}

int AllreduceEngine::piecesPer(const Op& op, Phase phase) const {
  // A reduce-scatter sends a local peer the parts of the M ranks of its rail;
  // an all-gather forwards the M parts of its own rail.
  const bool mParts = (op.kind == OpKind::kReduceScatter && phase == Phase::kReduceScatter) ||
      (op.kind == OpKind::kAllGather && phase == Phase::kAllGather);
  return mParts ? layout_.numMachines() : 1;
}

std::string AllreduceEngine::phaseLabel(const Op& op, Phase phase) const {
  if (op.kind == OpKind::kAllGather) {
    switch (phase) {
      case Phase::kReduceScatter: return "ready";
      case Phase::kCollect: return "rail gather";
      default: break;
    }
  }
  return phaseName(phase);
}

void AllreduceEngine::run(Actions& actions) {
  for (auto& a : actions) {
    a();
  }
  actions.clear();
}

at::Tensor AllreduceEngine::view(const Op& op, Range range) const {
  return op.work.slice(0, range.begin, range.end);
}

void AllreduceEngine::pump(Actions& actions) {
  while (!waitingForSlot_.empty()) {
    auto [seq, s] = waitingForSlot_.front();
    auto it = ops_.find(seq);
    if (it == ops_.end()) {
      waitingForSlot_.pop_front();
      continue;
    }
    Slice& slice = it->second->slices[s];
    // An all-gather stages nothing (every message lands in its output), but
    // its slices still activate in the global order: that is what keeps its
    // messages in order on the reduce lane.
    if (it->second->kind != OpKind::kAllGather) {
      const int slot = staging_.tryAcquire();
      if (slot < 0) {
        return;
      }
      slice.slot = slot;
      slice.staging = staging_.data(slot);
    }
    waitingForSlot_.pop_front();
    activate(*it->second, slice, actions);
  }
}

void AllreduceEngine::activate(Op& op, Slice& slice, Actions& actions) {
  slice.active = true;
  stamp(timeline_, slice.tActive);
  const int L = layout_.localSize();
  const int l = layout_.localRank();
  const int m = layout_.machine();
  if (!op.isAllreduce()) {
    openSharded(op, slice, actions);
  } else {
    // Every segment's reduce-scatter at once, in segment order: the staging
    // slot has room for all of them.
    for (Segment& seg : slice.segments) {
      for (int k = 1; k < L; ++k) {
        const int j = (l + k) % L;
        sendPiece(
            op, slice, seg, layout_.rankOf(m, j), Phase::kReduceScatter, op.plan.chunk(slice.index, seg.index, j),
            actions);
      }
    }
  }
  auto parked = parked_.find({op.seq, slice.index});
  if (parked != parked_.end()) {
    std::vector<Parked> waiting = std::move(parked->second);
    parked_.erase(parked);
    for (size_t i = 0; i < waiting.size(); ++i) {
      if (op.seq >= failSeq_) {
        // The operation failed while delivering: drop the rest unread.
        discard(waiting[i].peer, laneOf(waiting[i].header.phase), waiting[i].bytes, actions);
      } else {
        deliver(op, slice, waiting[i].peer, waiting[i].header, waiting[i].bytes, actions);
      }
    }
    if (op.seq >= failSeq_) {
      return;
    }
  }
  for (Segment& seg : slice.segments) {
    advance(op, slice, seg, actions);
  }
}

void AllreduceEngine::sendPiece(
    Op& op,
    Slice& slice,
    Segment& seg,
    int peer,
    Phase phase,
    Range range,
    Actions& actions) {
  sendBytes(op, slice, seg, peer, phase, 0, op.at(range), static_cast<size_t>(range.size()) * op.elemSize, actions);
}

void AllreduceEngine::sendBytes(
    Op& op,
    Slice& slice,
    Segment& seg,
    int peer,
    Phase phase,
    int piece,
    uint8_t* data,
    size_t bytes,
    Actions& actions) {
  const Lane lane = laneOf(phase);
  const int key = outboxOf(peer);
  if (lane == Lane::kReduce && !sendOrder_.queued(op.seq, key)) {
    failLocked(
        "fairring: internal error: " + std::string(opKindName(op.kind)) + " #" + std::to_string(op.seq) +
            " sends more reduce-lane messages to " + layout_.describe(peer) + " than it announced",
        actions);
    return;
  }
  ++seg.sendsInFlight;
  Outbox& box = outboxes_[{key, lane}];
  Outgoing out{encode(op.header(slice.index, seg.index, phase, piece)), data, bytes, op.seq, slice.index, seg.index, peer};
  // On the reduce lane, behind every message of its own or an earlier
  // operation: a message held by SendOrder must not hold an earlier one back.
  auto at = box.queue.end();
  while (lane == Lane::kReduce && at != box.queue.begin() && std::prev(at)->seq > op.seq) {
    --at;
  }
  box.queue.insert(at, std::move(out));
  if (!box.draining) {
    box.draining = true;
    actions.push_back([this, key, lane] { drain(key, lane); });
  }
}

int AllreduceEngine::outboxOf(int peer) const {
  return layout_.machineOf(peer) == layout_.machine() ? peer : kRailPeers;
}

void AllreduceEngine::drain(int key, Lane lane) {
  for (;;) {
    Outgoing next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Outbox& box = outboxes_[{key, lane}];
      // Messages of failed operations are dropped; earlier ones still go.
      while (!box.queue.empty() && box.queue.front().seq >= failSeq_) {
        box.queue.pop_front();
      }
      if (box.queue.empty() || meshClosed_) {
        box.queue.clear();
        box.draining = false;
        return;
      }
      if (lane == Lane::kReduce && !sendOrder_.mayLeave(box.queue.front().seq, key)) {
        // An earlier operation has yet to queue its messages here; queueing
        // them starts a drainer again.
        box.draining = false;
        return;
      }
      next = std::move(box.queue.front());
      box.queue.pop_front();
    }
    const uint64_t seq = next.seq;
    const int64_t s = next.slice;
    const int g = next.segment;
    const int peer = next.peer;
    mesh_->send(peer, lane, std::move(next.header), next.data, next.bytes, [this, seq, s, g, peer](Status status) {
      onSent(seq, s, g, peer, std::move(status));
    });
  }
}

void AllreduceEngine::advance(Op& op, Slice& slice, Segment& seg, Actions& actions) {
  if (!slice.active || seg.done || seg.reducing) {
    return;
  }
  if (op.kind == OpKind::kReduceScatter) {
    advanceReduceScatter(op, slice, seg, actions);
    return;
  }
  if (op.kind == OpKind::kAllGather) {
    advanceAllGather(op, slice, seg, actions);
    return;
  }
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  const int l = layout_.localRank();
  const int m = layout_.machine();
  const int64_t s = slice.index;
  const int g = seg.index;
  const int64_t elem = static_cast<int64_t>(op.elemSize);
  const int64_t maxChunkBytes = op.plan.maxChunkElems() * elem;
  const int64_t maxShardBytes = op.plan.maxShardElems() * elem;

  if (!seg.rsReduced) {
    if (seg.received[static_cast<int>(Phase::kReduceScatter)] < L - 1) {
      return;
    }
    if (L == 1) {
      seg.rsReduced = true;
      stamp(timeline_, seg.tRsReduced);
    } else {
      // Sum the other local ranks' copies of my chunk into my own.
      reduceLater(op, slice, seg, op.plan.chunk(s, g, l), slice.staging + op.plan.chunkOffset(g) * elem,
                  maxChunkBytes, L - 1, false, [this](Slice&, Segment& done, Actions&) {
                    done.rsReduced = true;
                    stamp(timeline_, done.tRsReduced);
                  });
      return;
    }
  }

  if (M > 1 && !seg.collectSent) {
    seg.collectSent = true;
    for (int k = 1; k < M; ++k) {
      const int to = (m + k) % M;
      sendPiece(op, slice, seg, layout_.rankOf(to, l), Phase::kCollect, op.plan.shard(s, g, l, to), actions);
    }
  }

  if (!seg.shardReduced) {
    if (seg.received[static_cast<int>(Phase::kCollect)] < M - 1) {
      return;
    }
    stamp(timeline_, seg.tReduceStart);
    // Sum the other machines' copies of my shard into mine, then finish (AVG).
    reduceLater(op, slice, seg, op.plan.shard(s, g, l, m),
                slice.staging + (L - 1) * maxChunkBytes + op.plan.shardOffset(g) * elem, maxShardBytes, M - 1, true,
                [this](Slice& sl, Segment& done, Actions& actions) {
                  done.shardReduced = true;
                  stamp(timeline_, done.tShardReduced);
                  // Everything the slice receives once all its segments are
                  // here lands in place: its slot can serve another slice.
                  if (--sl.segmentsStaged == 0) {
                    staging_.release(sl.slot);
                    sl.slot = -1;
                    sl.staging = nullptr;
                    pump(actions);
                  }
                });
    return;
  }

  if (M > 1 && !seg.diffuseSent) {
    seg.diffuseSent = true;
    for (int k = 1; k < M; ++k) {
      const int to = (m + k) % M;
      sendPiece(op, slice, seg, layout_.rankOf(to, l), Phase::kDiffuse, op.plan.shard(s, g, l, m), actions);
    }
  }

  if (!seg.chunkFinal) {
    if (seg.received[static_cast<int>(Phase::kDiffuse)] < M - 1) {
      return;
    }
    seg.chunkFinal = true;
    stamp(timeline_, seg.tChunkFinal);
  }

  if (L > 1 && !seg.agSent) {
    seg.agSent = true;
    for (int k = 1; k < L; ++k) {
      const int j = (l + k) % L;
      sendPiece(op, slice, seg, layout_.rankOf(m, j), Phase::kAllGather, op.plan.chunk(s, g, l), actions);
    }
  }

  if (seg.received[static_cast<int>(Phase::kAllGather)] < L - 1 || seg.sendsInFlight > 0 || seg.pendingReads > 0) {
    return;
  }
  finishSegment(op, slice, seg, actions);
}

void AllreduceEngine::reduceLater(
    Op& op,
    Slice& slice,
    Segment& seg,
    Range mine,
    uint8_t* firstPiece,
    int64_t pieceStride,
    int numPieces,
    bool last,
    std::function<void(Slice&, Segment&, Actions&)> then) {
  at::Tensor dst = view(op, mine);
  std::vector<at::Tensor> pieces;
  for (int p = 0; p < numPieces; ++p) {
    pieces.push_back(at::from_blob(firstPiece + p * pieceStride, {mine.size()}, op.work.options()));
  }
  const RedOp redop = op.op;
  const int worldSize = layout_.worldSize();
  reduceTask(
      op, slice, seg,
      [dst, pieces, redop, worldSize, last] {
        for (const auto& piece : pieces) {
          reduceInto(dst, piece, redop);
        }
        if (last) {
          finishReduction(dst, redop, worldSize);
        }
      },
      std::move(then));
}

void AllreduceEngine::reduceTask(
    Op& op,
    Slice& slice,
    Segment& seg,
    std::function<void()> task,
    std::function<void(Slice&, Segment&, Actions&)> then) {
  seg.reducing = true;
  const uint64_t seq = op.seq;
  const int64_t s = slice.index;
  const int g = seg.index;
  tasks_.post([this, seq, s, g, task = std::move(task), then = std::move(then)] {
    task();
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = ops_.find(seq);
      if (it != ops_.end()) {
        Slice& slice = it->second->slices[s];
        Segment& seg = slice.segments[g];
        seg.reducing = false;
        then(slice, seg, actions);
        advance(*it->second, slice, seg, actions);
      }
    }
    run(actions);
  });
}

void AllreduceEngine::finishSegment(Op& op, Slice& slice, Segment& seg, Actions& actions) {
  seg.done = true;
  recordSegment(op, slice, seg);
  // A reduce-scatter sends its partial sums from the slot: it is free only
  // once those sends are done too.
  if (op.kind == OpKind::kReduceScatter && --slice.segmentsStaged == 0) {
    staging_.release(slice.slot);
    slice.slot = -1;
    slice.staging = nullptr;
    pump(actions);
  }
  if (--slice.segmentsLeft == 0) {
    finishSlice(op, slice, actions);
  }
}

void AllreduceEngine::finishSlice(Op& op, Slice& slice, Actions& actions) {
  slice.done = true;
  if (--op.slicesLeft > 0) {
    return;
  }
  recordOp(op);
  if (sendOrder_.expecting(op.seq)) {
    // It would hold every later operation's messages forever.
    failLocked(
        "fairring: internal error: " + std::string(opKindName(op.kind)) + " #" + std::to_string(op.seq) +
            " finished without sending every reduce-lane message it announced",
        actions, op.seq);
    return;
  }
  auto it = ops_.find(op.seq);
  std::shared_ptr<Op> finished(std::move(it->second));
  ops_.erase(it);
  cv_.notify_all(); // shutdownAll may be waiting for ops_ to empty
  actions.push_back([this, finished] {
    auto complete = [finished] {
      try {
        if (finished->finish) {
          finished->finish();
        }
        finished->future->markCompleted(c10::IValue(finished->outputs));
      } catch (const std::exception& e) {
        if (!finished->future->completed()) {
          finished->future->setError(makeError(std::string("fairring: completing allreduce failed: ") + e.what()));
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

void AllreduceEngine::recordSegment(const Op& op, const Slice& slice, const Segment& seg) {
  if (!timeline_.enabled()) {
    return;
  }
  const int64_t tDone = Timeline::now();
  const bool intraNode = layout_.localSize() > 1;
  const bool rail = layout_.numMachines() > 1;
  const std::string elements = op.isAllreduce()
      ? "\"elements\":" + std::to_string(op.plan.segment(slice.index, seg.index).size())
      : "\"elements_per_rank\":" + std::to_string(op.sharded.segment(slice.index, seg.index).size());
  const std::string args = "{\"op\":" + std::to_string(op.seq) + ",\"slice\":" + std::to_string(slice.index) +
      ",\"segment\":" + std::to_string(seg.index) + "," + elements + "}";
  // A phase this shape does not have (no peers on the machine, or one machine) is not drawn.
  auto span = [&](const char* name, int64_t begin, int64_t end, bool shown) {
    if (shown) {
      timeline_.sliceSpan(seg.id, name, begin, end, args);
    }
  };
  if (op.kind == OpKind::kAllGather) {
    span("waiting for its turn", op.tEnqueued, slice.tActive, true);
    span("rail gather", slice.tActive, seg.tChunkFinal, rail);
    span("all-gather", seg.tChunkFinal, tDone, intraNode);
    return;
  }
  span("waiting for staging", op.tEnqueued, slice.tActive, true);
  span("reduce-scatter", slice.tActive, seg.tRsReduced, intraNode);
  span("collect", seg.tRsReduced, seg.tReduceStart, rail);
  span("reduce", seg.tReduceStart, seg.tShardReduced, true);
  if (op.isAllreduce()) {
    span("diffuse", seg.tShardReduced, seg.tChunkFinal, rail);
    span("all-gather", seg.tChunkFinal, tDone, intraNode);
  }
}

void AllreduceEngine::recordOp(const Op& op) {
  if (!timeline_.enabled()) {
    return;
  }
  const DataHeader h = op.header(0, 0, Phase::kReduceScatter);
  timeline_.span(
      "ops", std::string(opKindName(op.kind)) + " #" + std::to_string(op.seq), op.tEnqueued, Timeline::now(),
      "{\"elements\":" + std::to_string(h.numel) + ",\"dtype\":\"" +
          dtypeName(op.work.scalar_type()) + "\",\"op\":\"" + opName(op.op) +
          "\",\"slices\":" + std::to_string(op.slices.size()) + "}");
}

std::string AllreduceEngine::describeOp(const DataHeader& h) const {
  const auto kind = static_cast<OpKind>(h.kind);
  const std::string what = kind == OpKind::kAllreduce ? "" : std::string(opKindName(kind)) + " of ";
  const std::string perRank = kind == OpKind::kAllreduce ? "" : " per rank";
  const std::string reduction = kind == OpKind::kAllGather ? "" : " with ReduceOp." + opName(static_cast<RedOp>(h.op));
  return what + std::to_string(h.numel) + " elements" + perRank + " of " +
      dtypeName(static_cast<at::ScalarType>(h.dtype)) + reduction;
}

bool AllreduceEngine::sameOp(const Op& op, const DataHeader& h) const {
  const DataHeader mine = op.header(0, 0, h.phase);
  return h.numel == mine.numel && h.dtype == mine.dtype && h.op == mine.op && h.kind == mine.kind && h.slice >= 0 &&
      h.slice < static_cast<int64_t>(op.slices.size()) && h.segment >= 0 &&
      h.segment < static_cast<int32_t>(op.slices[h.slice].segments.size());
}

std::string AllreduceEngine::describeMismatch(const Op& op, int peer, const DataHeader& h) const {
  return "fairring: " + std::string(opKindName(op.kind)) + " #" + std::to_string(op.seq) + " differs between ranks: " +
      layout_.describe(layout_.rank()) + " has " + describeOp(op.header(0, 0, h.phase)) + ", " +
      layout_.describe(peer) + " has " + describeOp(h);
}

void AllreduceEngine::onMessage(int peer, Lane lane, Status status, std::string header, size_t bytes) {
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || meshClosed_) {
      return;
    }
    if (!status.ok()) {
      // A peer that finished everything may close before we have read its
      // last bytes' successors; that is only an error if we wait on it.
      if (needsFrom(peer, lane)) {
        lostPeerLocked(status.message(), actions);
      } else if (departed_.empty()) {
        departed_ = status.message();
      }
    } else if (auto abort = decodeAbort(header)) {
      failLocked(abort->reason + " (reported to " + layout_.describe(layout_.rank()) + " by " +
                     layout_.describe(peer) + ")",
                 actions, abort->fromSeq);
      // Finish reading it: earlier operations' messages queue behind it.
      discard(peer, lane, bytes, actions);
    } else if (auto h = decodeData(header); !h || laneOf(h->phase) != lane) {
      failLocked("fairring: malformed message from " + layout_.describe(peer), actions);
    } else if (h->opSeq >= failSeq_) {
      discard(peer, lane, bytes, actions);
    } else {
      auto it = ops_.find(h->opSeq);
      if (it != ops_.end()) {
        Op& op = *it->second;
        if (!sameOp(op, *h)) {
          failLocked(describeMismatch(op, peer, *h), actions, op.seq);
        } else if (!op.slices[h->slice].active) {
          parked_[{h->opSeq, h->slice}].push_back(Parked{peer, *h, bytes});
        } else {
          deliver(op, op.slices[h->slice], peer, *h, bytes, actions);
        }
      } else if (h->opSeq < nextSeq_) {
        failLocked(
            "fairring: " + std::string(opKindName(static_cast<OpKind>(h->kind))) + " #" + std::to_string(h->opSeq) +
                " differs between ranks: " +
                layout_.describe(peer) + " sent " + describeOp(*h) + " but it has already finished on " +
                layout_.describe(layout_.rank()) + " (with fewer elements)",
            actions, h->opSeq);
      } else {
        // The peer is ahead of us; the pipe waits until we post this operation.
        parked_[{h->opSeq, h->slice}].push_back(Parked{peer, *h, bytes});
      }
    }
  }
  run(actions);
}

void AllreduceEngine::deliver(Op& op, Slice& slice, int peer, const DataHeader& h, size_t bytes, Actions& actions) {
  if (!sameOp(op, h)) {
    failLocked(describeMismatch(op, peer, h), actions, op.seq);
    return;
  }
  const int L = layout_.localSize();
  const int l = layout_.localRank();
  const int m = layout_.machine();
  const int64_t s = h.slice;
  const int g = h.segment;
  Segment& seg = slice.segments[g];
  const bool intraNode = h.phase == Phase::kReduceScatter || h.phase == Phase::kAllGather;
  const bool samePlace = intraNode ? layout_.machineOf(peer) == m : layout_.localRankOf(peer) == l;
  const int from = intraNode ? layout_.localRankOf(peer) : layout_.machineOf(peer);
  const int phase = static_cast<int>(h.phase);
  const int pieces = piecesPer(op, h.phase);
  const size_t index = static_cast<size_t>(from) * pieces + h.piece;
  Range range;
  uint8_t* dst = nullptr;
  if (!samePlace || peer == layout_.rank() || h.piece < 0 || h.piece >= pieces ||
      index >= seg.announced[phase].size() || seg.announced[phase][index] ||
      (!op.isAllreduce() && !shardedTarget(op, slice, seg, h.phase, from, h.piece, range, dst))) {
    failLocked(
        "fairring: unexpected " + phaseLabel(op, h.phase) + " message from " + layout_.describe(peer) + " for " +
            opKindName(op.kind) + " #" + std::to_string(op.seq),
        actions);
    return;
  }
  const int64_t elem = static_cast<int64_t>(op.elemSize);
  const int64_t maxChunkBytes = op.plan.maxChunkElems() * elem;
  const int64_t maxShardBytes = op.plan.maxShardElems() * elem;
  switch (op.isAllreduce() ? h.phase : static_cast<Phase>(kNumPhases)) {
    case Phase::kReduceScatter:
      range = op.plan.chunk(s, g, l);
      dst = slice.staging + (from < l ? from : from - 1) * maxChunkBytes + op.plan.chunkOffset(g) * elem;
      break;
    case Phase::kCollect:
      range = op.plan.shard(s, g, l, m);
      dst = slice.staging + (L - 1) * maxChunkBytes + (from < m ? from : from - 1) * maxShardBytes +
          op.plan.shardOffset(g) * elem;
      break;
    case Phase::kDiffuse:
      range = op.plan.shard(s, g, l, from);
      dst = op.at(range);
      break;
    case Phase::kAllGather:
      range = op.plan.chunk(s, g, from);
      dst = op.at(range);
      break;
    default: break; // set by shardedTarget
  }
  const size_t expected = static_cast<size_t>(range.size()) * op.elemSize;
  if (bytes != expected) {
    failLocked(
        "fairring: " + layout_.describe(peer) + " sent " + std::to_string(bytes) + " bytes for the " +
            phaseLabel(op, h.phase) + " of " + opKindName(op.kind) + " #" + std::to_string(op.seq) + " where " +
            std::to_string(expected) + " were expected",
        actions);
    return;
  }
  seg.announced[phase][index] = 1;
  ++seg.pendingReads;
  const uint64_t seq = op.seq;
  const Phase p = h.phase;
  actions.push_back([this, peer, p, dst, bytes, seq, s, g] {
    mesh_->receive(peer, laneOf(p), dst, bytes, [this, seq, s, g, p](Status status) {
      onReceived(seq, s, g, p, std::move(status));
    });
  });
}

void AllreduceEngine::onReceived(uint64_t seq, int64_t s, int g, Phase phase, Status status) {
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || meshClosed_) {
      return;
    }
    if (!status.ok()) {
      failLocked(status.message(), actions);
    } else if (auto it = ops_.find(seq); it != ops_.end()) {
      Slice& slice = it->second->slices[s];
      Segment& seg = slice.segments[g];
      --seg.pendingReads;
      ++seg.received[static_cast<int>(phase)];
      advance(*it->second, slice, seg, actions);
    }
  }
  run(actions);
}

void AllreduceEngine::onSent(uint64_t seq, int64_t s, int g, int peer, Status status) {
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || meshClosed_) {
      return;
    }
    // A failed send does not make this rank's result wrong: only data it still
    // has to receive can. (A peer that finished and exited may drop the
    // acknowledgement of bytes it did read from its memory.) So the
    // send counts as over, the peer as gone, and work fails only if it waits
    // on that peer.
    if (!status.ok()) {
      if (needsFrom(peer, Lane::kReduce) || needsFrom(peer, Lane::kGather)) {
        lostPeerLocked(status.message(), actions);
      } else if (departed_.empty()) {
        departed_ = status.message();
      }
    }
    // An operation that failed is gone from ops_; earlier ones carry on.
    if (auto it = ops_.find(seq); it != ops_.end()) {
      Slice& slice = it->second->slices[s];
      Segment& seg = slice.segments[g];
      --seg.sendsInFlight;
      advance(*it->second, slice, seg, actions);
    }
  }
  run(actions);
}

void AllreduceEngine::failLocked(const std::string& message, Actions& actions, uint64_t fromSeq) {
  if (failure_.empty()) {
    failure_ = message;
    failedAt_ = Clock::now();
  }
  if (fromSeq >= failSeq_) {
    return; // those operations have failed already
  }
  failSeq_ = fromSeq;
  sendOrder_.dropFrom(fromSeq);
  // Before start() has connected to every peer, some connections do not exist
  // yet; start() sends the aborts once they do.
  if (!stopping_ && meshStarted_) {
    queueAbortsLocked(message, fromSeq, actions);
  }
  for (auto it = ops_.lower_bound(fromSeq); it != ops_.end();) {
    auto future = it->second->future;
    actions.push_back([future, message] { future->setError(makeError(message)); });
    graveyard_.push_back(std::move(it->second));
    it = ops_.erase(it);
  }
  for (auto it = parked_.lower_bound({fromSeq, 0}); it != parked_.end();) {
    for (const Parked& p : it->second) {
      discard(p.peer, laneOf(p.header.phase), p.bytes, actions);
    }
    it = parked_.erase(it);
  }
  cv_.notify_all();
}

void AllreduceEngine::queueAbortsLocked(const std::string& message, uint64_t fromSeq, Actions& actions) {
  // On every lane: a peer may hold either one at a message it cannot take yet
  // (parked), and must still learn the reason before it sees this rank close.
  for (int peer : layout_.peers()) {
    for (int l = 0; l < kNumLanes; ++l) {
      ++abortsInFlight_;
      actions.push_back([this, peer, l, message, fromSeq] {
        mesh_->send(peer, static_cast<Lane>(l), encode(Abort{message, fromSeq}), nullptr, 0, [this](Status) {
          std::lock_guard<std::mutex> lock(mu_);
          --abortsInFlight_;
          cv_.notify_all();
        });
      });
    }
  }
}

void AllreduceEngine::lostPeerLocked(const std::string& message, Actions& actions) {
  if (!failure_.empty()) {
    failLocked(message, actions);
    return;
  }
  if (closedBeforeReason_.empty()) {
    closedBeforeReason_ = message;
    closedAt_ = Clock::now();
  }
}

void AllreduceEngine::discard(int peer, Lane lane, size_t bytes, Actions& actions) {
  actions.push_back([this, peer, lane, bytes] { mesh_->receive(peer, lane, nullptr, bytes, [](Status) {}); });
}

bool AllreduceEngine::needsFrom(int peer, Lane lane) const {
  const bool local = layout_.machineOf(peer) == layout_.machine();
  const Phase phase = local ? (lane == Lane::kReduce ? Phase::kReduceScatter : Phase::kAllGather)
                            : (lane == Lane::kReduce ? Phase::kCollect : Phase::kDiffuse);
  const int from = local ? layout_.localRankOf(peer) : layout_.machineOf(peer);
  for (const auto& [seq, op] : ops_) {
    const int pieces = piecesPer(*op, phase);
    for (const Slice& slice : op->slices) {
      for (const Segment& seg : slice.segments) {
        const auto& announced = seg.announced[static_cast<int>(phase)];
        const auto first = announced.begin() + std::min<size_t>(announced.size(), static_cast<size_t>(from) * pieces);
        const auto last = announced.begin() + std::min<size_t>(announced.size(), static_cast<size_t>(from + 1) * pieces);
        if (seg.done || std::all_of(first, last, [](char a) { return a != 0; })) {
          continue;
        }
        auto parked = parked_.find({seq, slice.index});
        const bool isParked = parked != parked_.end() &&
            std::any_of(parked->second.begin(), parked->second.end(), [&](const Parked& p) {
                                return p.peer == peer && p.header.phase == phase && p.header.segment == seg.index;
                              });
        if (!isParked) {
          return true;
        }
      }
    }
  }
  return false;
}

std::string AllreduceEngine::describeWait(const Op& op) const {
  for (const Slice& slice : op.slices) {
    if (slice.done) {
      continue;
    }
    std::string where = "slice " + std::to_string(slice.index) + " of " + std::to_string(op.slices.size());
    if (!slice.active) {
      return where + " is waiting for a staging slot (earlier operations have not finished)";
    }
    for (const Segment& seg : slice.segments) {
      if (seg.done) {
        continue;
      }
      if (slice.segments.size() > 1) {
        where += ", segment " + std::to_string(seg.index) + " of " + std::to_string(slice.segments.size()) + ",";
      }
      std::string missing;
      for (int phase = 0; phase < kNumPhases; ++phase) {
        const bool intraNode = phase == 0 || phase == 3;
        const int pieces = piecesPer(op, static_cast<Phase>(phase));
        for (size_t i = 0; i < seg.announced[phase].size(); i += pieces) {
          const int from = static_cast<int>(i) / pieces;
          const int peer = intraNode ? layout_.rankOf(layout_.machine(), from) : layout_.rankOf(from, layout_.localRank());
          const bool all = std::all_of(
              seg.announced[phase].begin() + i, seg.announced[phase].begin() + i + pieces, [](char a) { return a != 0; });
          if (peer != layout_.rank() && !all) {
            missing += (missing.empty() ? "" : ", ") + phaseLabel(op, static_cast<Phase>(phase)) + " from " +
                layout_.describe(peer);
          }
        }
        if (!missing.empty()) {
          return where + " is waiting for " + missing;
        }
      }
      return where + " is waiting for its sends and receives to complete";
    }
  }
  return "it is finishing";
}

void AllreduceEngine::watchdog() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, std::chrono::milliseconds(100));
    if (stopping_) {
      break;
    }
    if (timeline_.enabled()) {
      lock.unlock();
      timeline_.flush();
      lock.lock();
    }
    // Close once the aborts are out (or after a grace period if a peer does
    // not take them): closing the pipes earlier would drop them.
    if (!failure_.empty() && !meshClosed_ && ops_.empty() &&
        (abortsInFlight_ == 0 || Clock::now() - failedAt_ > kAbortGrace)) {
      // Closing the pipes tells every peer at once that this rank has failed.
      meshClosed_ = true;
      lock.unlock();
      mesh_->close();
      lock.lock();
      graveyard_.clear();
      continue;
    }
    const auto now = Clock::now();
    if (!closedBeforeReason_.empty() && failure_.empty() && now - closedAt_ > kCloseGrace) {
      Actions actions;
      failLocked(closedBeforeReason_, actions);
      lock.unlock();
      run(actions);
      lock.lock();
      continue;
    }
    for (auto& [seq, op] : ops_) {
      if (now > op->deadline) {
        Actions actions;
        failLocked(
            "fairring: " + std::string(opKindName(op->kind)) + " #" + std::to_string(seq) + " (" +
                describeOp(op->header(0, 0, Phase::kReduceScatter)) +
                ") timed out after " + std::to_string(options_.timeout.count()) + " ms on " +
                layout_.describe(layout_.rank()) + ": " + describeWait(*op),
            actions);
        lock.unlock();
        run(actions);
        lock.lock();
        break;
      }
    }
  }
}

void AllreduceEngine::shutdown() {
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      return;
    }
    stopping_ = true;
    failLocked("fairring: the process group was shut down while this allreduce was in flight", actions);
  }
  cv_.notify_all();
  run(actions);
  if (watchdog_.joinable()) {
    watchdog_.join();
  }
  {
    // A rank that refused a call and destroys the group at once: the reason must
    // reach its peers before they see it close, or they report the close instead.
    // The same grace as the watchdog's, counted from the failure.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, failedAt_ + kAbortGrace, [this] { return abortsInFlight_ == 0 || meshClosed_; });
  }
  mesh_->close();
  tasks_.stop();
  timeline_.close();
  std::lock_guard<std::mutex> lock(mu_);
  graveyard_.clear();
}

} // namespace fairring
