// The engine's progress: slices take staging slots in turn order, and each
// segment runs its kind's steps (steps.h) until its operation completes.
// Admission is engine_admission.cpp's, messages engine_messages.cpp's,
// failure engine_failure.cpp's, the watchdog engine_watchdog.cpp's.

#include "pipeline/collective_engine.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "faults/fault_points.h"
#include "ops/reduce_kind.h"

namespace fairring {

CollectiveEngine::CollectiveEngine(RankLayout layout, EngineOptions options)
    : layout_(std::move(layout)),
      options_(std::move(options)),
      timeline_(options_.timelinePath, layout_.rank()),
      steps_{
          allreduceSteps(layout_), reduceScatterSteps(layout_), allGatherSteps(layout_), allreduceSteps(layout_),
          announceSteps(layout_)},
      ledger_(options_.totalMemory, options_.slotBytes),
      outboxes_(layout_) {
  TORCH_CHECK(
      options_.sliceBytes > 0 && options_.chunkBytes > 0 && options_.timeout.count() > 0,
      "fairring: the engine needs a slice size, a pipeline chunk and a timeout (fairring_pg.backend sets them)");
  // The slot's size is fairring_pg.sizing's rule; its layout is the steps'.
  for (const int64_t elem : {1, 2, 4, 8}) {
    const SliceCuts cuts(
        0, static_cast<int64_t>(options_.sliceBytes) / elem, static_cast<int64_t>(options_.chunkBytes) / elem,
        layout_.localSize(), layout_.numMachines());
    TORCH_CHECK(
        cuts.stagedBytes(elem) <= static_cast<int64_t>(options_.slotBytes), "fairring: a staging slot of ",
        options_.slotBytes, " bytes cannot hold a slice of ", options_.sliceBytes, " bytes of ", elem,
        "-byte elements (", cuts.stagedBytes(elem), " bytes): fairring_pg.sizing.staging_slot_bytes and the "
        "engine's layout disagree");
  }
  mesh_ = std::make_unique<PeerMesh>(
      layout_,
      PeerMesh::Options{
          options_.listenAddress, options_.token,
          options_.startTimeout.count() > 0 ? options_.startTimeout : options_.timeout, options_.railCongestion},
      [this](int peer, Track track, Status status, std::string header, size_t bytes) {
        onMessage(peer, track, std::move(status), std::move(header), bytes);
      });
  enlist(this);
}

void CollectiveEngine::start(const c10::intrusive_ptr<c10d::Store>& store, PeerMesh::GiveUp giveUp) {
  store_ = store;
  const Status status = mesh_->start(*store, std::move(giveUp));
  if (!status.ok()) {
    mesh_->close();
    throw c10::DistBackendError(status.message());
  }
  faults::hit(faults::kEngineStart);
  std::unique_lock<std::mutex> lock(mu_);
  Locked locked(lock);
  // A shutdown meanwhile (interpreter exit, a destroy) joined no watchdog:
  // none may start after it.
  if (life_.is(EngineLife::kShutDown)) {
    throw c10::DistBackendError("fairring: the process group was shut down while it was starting");
  }
  // A peer that failed while we were still connecting told us before we
  // could tell the peers we had not reached yet: they hear it now.
  if (auto held = failure_.connected()) {
    sendAborts(*held, locked);
  }
  watchdog_ = std::thread([this] { watchdog(); });
  locked.release();
}

void CollectiveEngine::pump(Locked& locked) {
  const auto stages = [this](const Operation& op) { return stepsOf(op).staged(); };
  while (auto ready = ledger_.nextReady(stages, locked)) {
    activate(*ready->op, *ready->slice, ready->staged ? SliceState::kStaged : SliceState::kActive, locked);
  }
}

void CollectiveEngine::activate(Operation& op, Slice& slice, SliceState state, Locked& locked) {
  slice.state.moveTo(state);
  timeline_.stamp(slice.tActive);
  for (Segment& seg : slice.segments) {
    seg.state.moveTo(SegmentState::kStepping);
    Turn t{op, slice, seg, *this, locked};
    stepsOf(op).open(t);
  }
  deliverParked(op, slice, locked);
  if (failure_.fails(op.seq)) {
    return;
  }
  for (Segment& seg : slice.segments) {
    Turn t{op, slice, seg, *this, locked};
    advance(t);
  }
}

void CollectiveEngine::deliverParked(Operation& op, Slice& slice, Locked& locked) {
  for (const Parked& p : inbox_.take(op.seq, slice.index, locked)) {
    if (failure_.fails(op.seq)) {
      // The operation failed while delivering: drop the rest unread.
      if (!p.consumed) {
        discard(p.peer, trackOf(p.header.route), p.bytes, locked);
      }
    } else {
      deliver(op, slice, p.peer, p.header, p.bytes, locked, p.consumed);
    }
  }
}

void CollectiveEngine::advance(Turn& t) {
  const KindSteps& steps = stepsOf(t.op);
  while (t.seg.state.is(SegmentState::kStepping)) {
    if (t.seg.step >= steps.numSteps()) {
      finishSegment(t);
      return;
    }
    switch (steps.run(t)) {
      case Next::kWait: return;
      case Next::kReducing: t.seg.state.moveTo(SegmentState::kReducing); return;
      case Next::kDone: endStep(t); break;
    }
  }
}

void CollectiveEngine::endStep(Turn& t) {
  timeline_.stamp(t.seg.stepEnded[t.seg.step]);
  ++t.seg.step;
}

void CollectiveEngine::send(Turn& t, int peer, Route route, int piece, uint8_t* data, size_t bytes) {
  const Track track = trackOf(route);
  Outboxes::Message message{
      encode(t.op.header(t.slice.index, t.seg.index, route, piece)), data, bytes, t.op.seq, t.slice.index,
      t.seg.index, peer};
  switch (outboxes_.queue(track, std::move(message))) {
    case Outboxes::Queued::kUnannounced:
      failLocked(
          "fairring: internal error: " + std::string(opKindName(t.op.kind)) + " #" + std::to_string(t.op.seq) +
              " sends more reduce-track messages to " + layout_.describe(peer) + " than it announced",
          t.locked);
      return;
    case Outboxes::Queued::kStartDrainer:
      t.locked.later([this, key = outboxes_.keyOf(peer), track] { drain(key, track); });
      break;
    case Outboxes::Queued::kQueued: break;
  }
  ++t.seg.sendsInFlight;
}

void CollectiveEngine::drain(int key, Track track) {
  for (;;) {
    std::optional<Outboxes::Message> next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      next = outboxes_.next(key, track, failure_.failSeq(), !life_.is(EngineLife::kOpen));
      if (!next) {
        return;
      }
    }
    const uint64_t seq = next->seq;
    const int64_t s = next->slice;
    const int g = next->segment;
    const int peer = next->peer;
    mesh_->send(peer, track, std::move(next->header), next->data, next->bytes, [this, seq, s, g, peer](Status status) {
      onSent(seq, s, g, peer, std::move(status));
    });
  }
}

void CollectiveEngine::reduce(Turn& t, std::function<void()> task) {
  timeline_.stamp(t.seg.reduceStarted);
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
    std::unique_lock<std::mutex> lock(mu_);
    Locked locked(lock);
    Operation* op = ledger_.find(seq, locked);
    if (!error.empty()) {
      // This operation cannot finish here, so nowhere: it fails on every rank.
      failLocked(
          "fairring: a reduction of " + (op ? std::string(opKindName(op->kind)) : "operation") + " #" +
              std::to_string(seq) + " failed on " + layout_.describe(layout_.rank()) + ": " + error,
          locked, seq);
    } else if (op) {
      Slice& slice = op->slices[s];
      Turn t{*op, slice, slice.segments[g], *this, locked};
      t.seg.state.moveTo(SegmentState::kStepping);
      endStep(t);
      advance(t);
    }
    locked.release();
  });
}

void CollectiveEngine::unstage(Turn& t) {
  if (--t.slice.segmentsStaged > 0 || !t.slice.state.is(SliceState::kStaged)) {
    return;
  }
  ledger_.releaseSlot(t.slice, t.locked);
  t.slice.state.moveTo(SliceState::kActive);
  pump(t.locked);
}

void CollectiveEngine::finishSegment(Turn& t) {
  t.seg.state.moveTo(SegmentState::kDone);
  recordSegment(t.op, t.slice, t.seg);
  if (--t.slice.segmentsLeft == 0) {
    t.slice.state.moveTo(SliceState::kDone);
    if (--t.op.slicesLeft == 0) {
      finishOperation(t.op, t.locked);
    }
  }
}

void CollectiveEngine::finishOperation(Operation& op, Locked& locked) {
  recordOp(op);
  if (outboxes_.expecting(op.seq)) {
    // It would hold every later operation's messages forever.
    failLocked(
        "fairring: internal error: " + std::string(opKindName(op.kind)) + " #" + std::to_string(op.seq) +
            " finished without sending every reduce-track message it announced",
        locked, op.seq);
    return;
  }
  op.state.moveTo(OpState::kFinished);
  std::shared_ptr<Operation> finished = ledger_.retire(op.seq, locked);
  cv_.notify_all(); // shutdownAll may be waiting for the ledger to empty
  complete(std::move(finished), locked);
}

void CollectiveEngine::complete(std::shared_ptr<Operation> finished, Locked& locked) {
  locked.later([this, finished] {
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
