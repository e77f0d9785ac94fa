// The engine's side of failure: GroupFailure decides (the rules are there);
// this fails the operations it names, sends the aborts it asks for, closes
// the connections when it allows, and enforces the group's timeout.

#include <pthread.h>

#include <c10/util/Exception.h>

#include <algorithm>

#include "ops/reduce_kind.h"
#include "pipeline/allreduce_engine.h"

namespace fairring {

using Clock = std::chrono::steady_clock;

namespace {
std::exception_ptr makeError(const std::string& message) {
  return std::make_exception_ptr(c10::DistBackendError(message));
}
} // namespace

void AllreduceEngine::failLocked(const std::string& message, Actions& actions, uint64_t fromSeq) {
  if (!failure_.fail(message, fromSeq)) {
    return; // those operations have failed already
  }
  outboxes_.dropFrom(fromSeq);
  if (auto abort = failure_.abortDue(stopping_)) {
    sendAborts(*abort, actions);
  }
  for (auto it = ops_.lower_bound(fromSeq); it != ops_.end();) {
    auto future = it->second->future;
    actions.push_back([future, message] { future->setError(makeError(message)); });
    graveyard_.push_back(std::move(it->second));
    it = ops_.erase(it);
  }
  for (auto it = outsideTurns_.lower_bound(fromSeq); it != outsideTurns_.end();) {
    actions.push_back([fail = std::move(it->second), message] { fail(message); });
    it = outsideTurns_.erase(it);
  }
  for (auto it = parked_.lower_bound({fromSeq, 0}); it != parked_.end();) {
    for (const Parked& p : it->second) {
      discard(p.peer, laneOf(p.header.phase), p.bytes, actions);
    }
    it = parked_.erase(it);
  }
  cv_.notify_all();
}

void AllreduceEngine::sendAborts(const GroupFailure::Abort& abort, Actions& actions) {
  // On every lane: a peer may hold either one at a message it cannot take yet
  // (parked), and must still learn the reason before it sees this rank close.
  // Ahead of the data queued there: the reason must not wait behind it.
  const std::vector<int> peers = layout_.peers();
  failure_.abortsQueued(static_cast<int>(peers.size()) * kNumLanes, Clock::now());
  for (int peer : peers) {
    for (int l = 0; l < kNumLanes; ++l) {
      actions.push_back([this, peer, l, abort] {
        mesh_->send(
            peer, static_cast<Lane>(l), encode(Abort{abort.reason, abort.fromSeq}), nullptr, 0,
            [this](Status) {
              failure_.abortLeft();
              std::lock_guard<std::mutex> lock(mu_);
              cv_.notify_all();
            },
            PeerMesh::Priority::kFirst);
      });
    }
  }
}

void AllreduceEngine::lostPeerLocked(bool needed, const std::string& message, Actions& actions) {
  if (auto now = failure_.peerLost(message, needed)) {
    failLocked(*now, actions);
  }
  cv_.notify_all(); // a ring call that failed waits to name the lost peer (turnFailed)
}

void AllreduceEngine::watchdog() {
  pthread_setname_np(pthread_self(), "fairring-watch");
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
    // Close once no operation before the failed turn is left (a slower rank
    // may not have posted them yet) and the aborts are out: closing earlier
    // would drop them.
    if (failure_.failed() && !meshClosed_ && ops_.empty() && nextSeq_ >= failure_.failSeq() &&
        failure_.mayClose(Clock::now())) {
      // Closing the connections tells every peer at once that this rank has failed.
      meshClosed_ = true;
      lock.unlock();
      mesh_->close();
      lock.lock();
      graveyard_.clear();
      continue;
    }
    checkDeadlines(lock);
  }
}

void AllreduceEngine::checkDeadlines(std::unique_lock<std::mutex>& lock) {
  const auto now = Clock::now();
  for (auto& [seq, op] : ops_) {
    if (now <= op->deadline) {
      continue;
    }
    Actions actions;
    failLocked(
        "fairring: " + std::string(opKindName(op->kind)) + " #" + std::to_string(seq) + " (" +
            describeOp(op->header(0, 0, Phase::kReduceScatter)) + ") timed out after " +
            std::to_string(options_.timeout.count()) + " ms on " + layout_.describe(layout_.rank()) + ": " +
            describeWait(*op),
        actions);
    lock.unlock();
    run(actions);
    lock.lock();
    return;
  }
}

std::string AllreduceEngine::describeWait(const Operation& op) const {
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
      return where + " is " + describeSegmentWait(op, seg);
    }
  }
  return "it is finishing";
}

std::string AllreduceEngine::describeSegmentWait(const Operation& op, const Segment& seg) const {
  const KindSteps& steps = stepsOf(op);
  const std::string at = std::string(" (step ") + steps.stepName(seg.step) + ")";
  for (int phase = 0; phase < kNumPhases; ++phase) {
    const Phase p = static_cast<Phase>(phase);
    const bool intraNode = p == Phase::kReduceScatter || p == Phase::kAllGather;
    const size_t pieces = static_cast<size_t>(std::max(1, steps.piecesPer(p)));
    std::string missing;
    const auto& announced = seg.announced[phase];
    for (size_t i = 0; i < announced.size(); i += pieces) {
      const int from = static_cast<int>(i / pieces);
      const int peer =
          intraNode ? layout_.rankOf(layout_.machine(), from) : layout_.rankOf(from, layout_.localRank());
      const bool all = std::all_of(announced.begin() + i, announced.begin() + i + pieces, [](char a) { return a != 0; });
      if (peer != layout_.rank() && !all) {
        missing += (missing.empty() ? "" : ", ") + steps.phaseLabel(p) + " from " + layout_.describe(peer);
      }
    }
    if (!missing.empty()) {
      return "waiting for " + missing + at;
    }
  }
  return "waiting for its sends and receives to complete" + at;
}

void AllreduceEngine::recordSegment(const Operation& op, const Slice& slice, const Segment& seg) {
  if (!timeline_.enabled()) {
    return;
  }
  const int64_t tDone = Timeline::now();
  const std::string elements = op.sliced()
      ? "\"elements\":" + std::to_string(op.plan.segment(slice.index, seg.index).size())
      : "\"elements_per_rank\":" + std::to_string(op.sharded.segment(slice.index, seg.index).size());
  const std::string args = "{\"op\":" + std::to_string(op.seq) + ",\"slice\":" + std::to_string(slice.index) +
      ",\"segment\":" + std::to_string(seg.index) + "," + elements + "}";
  // A phase this shape does not have (no peers on the machine, or one machine) is not drawn.
  stepsOf(op).record(op, slice, seg, tDone, [&](const char* name, int64_t begin, int64_t end, bool shown) {
    if (shown) {
      timeline_.sliceSpan(seg.id, name, begin, end, args);
    }
  });
}

void AllreduceEngine::recordOp(const Operation& op) {
  if (!timeline_.enabled()) {
    return;
  }
  const DataHeader h = op.header(0, 0, Phase::kReduceScatter);
  timeline_.span(
      "ops", std::string(opKindName(op.kind)) + " #" + std::to_string(op.seq), op.tEnqueued, Timeline::now(),
      "{\"elements\":" + std::to_string(h.numel) + ",\"dtype\":\"" + dtypeName(op.work.scalar_type()) +
          "\",\"op\":\"" + opName(op.op) + "\",\"slices\":" + std::to_string(op.slices.size()) + "}");
}

void AllreduceEngine::shutdown() {
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      return;
    }
    stopping_ = true;
    failLocked("fairring: the process group was shut down while this operation was in flight", actions);
  }
  cv_.notify_all();
  run(actions);
  // Closing the connections interrupts a start() still connecting; it then
  // starts no watchdog (stopping_).
  mesh_->interrupt();
  std::thread watchdog;
  {
    std::lock_guard<std::mutex> lock(mu_);
    watchdog.swap(watchdog_);
  }
  if (watchdog.joinable()) {
    watchdog.join();
  }
  {
    // A rank that refused a call and destroys the group at once: the reason must
    // reach its peers before they see it close, or they report the close instead.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, failure_.abortsDeadline(Clock::now()), [this] {
      return meshClosed_ || failure_.mayClose(Clock::now()) ;
    });
  }
  mesh_->close();
  tasks_.stop();
  timeline_.close();
  std::lock_guard<std::mutex> lock(mu_);
  graveyard_.clear();
}

} // namespace fairring
