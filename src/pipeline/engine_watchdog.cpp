// The watchdog: every 100 ms it flushes the timeline, closes the connections
// of a failed group once GroupFailure allows, and fails an operation past its
// deadline with what it was waiting for.

#include <pthread.h>

#include <algorithm>
#include <set>

#include "faults/plants.h"
#include "ops/reduce_kind.h"
#include "pipeline/collective_engine.h"

namespace fairring {

using Clock = std::chrono::steady_clock;

void CollectiveEngine::watchdog() {
  pthread_setname_np(pthread_self(), "fairring-watch");
  std::unique_lock<std::mutex> lock(mu_);
  Locked locked(lock);
  while (!life_.is(EngineLife::kShutDown)) {
    cv_.wait_for(lock, std::chrono::milliseconds(100));
    if (life_.is(EngineLife::kShutDown)) {
      break;
    }
    if (timeline_.enabled()) {
      locked.unlocked([this] { timeline_.flush(); });
    }
    if (life_.is(EngineLife::kOpen) && readyToClose(locked)) {
      // Closing the connections tells every peer at once that this rank has failed.
      life_.moveTo(EngineLife::kClosed);
      locked.unlocked([this] { mesh_->close(); });
      ledger_.freeBuried(locked);
      continue;
    }
    noteLongWaits(locked);
    actOnHeldCloses(locked);
    checkDeadlines(locked);
  }
}

void CollectiveEngine::actOnHeldCloses(Locked& locked) {
  if (!life_.is(EngineLife::kOpen)) {
    return;
  }
  const std::vector<int> due = closes_.heldLongerThan(Clock::now(), GroupFailure::kSendFailureWait);
  if (due.empty()) {
    return;
  }
  std::set<int> behind;
  if (!plants::planted(plants::Plant::kHeldCloseIgnoresLateGather)) {
    locked.unlocked([&] { // the mesh is not asked under the engine's lock
      for (int peer : due) {
        if (mesh_->readerBehind(peer, Track::kGather)) {
          behind.insert(peer);
        }
      }
    });
    if (!life_.is(EngineLife::kOpen)) {
      return;
    }
  }
  const auto now = Clock::now();
  for (auto& [peer, message] : closes_.expired(now, GroupFailure::kSendFailureWait, GroupFailure::kAbortGrace, behind)) {
    lostPeerLocked(needsFrom(peer, Track::kReduce, locked), message, locked);
  }
  locked.flush();
}

bool CollectiveEngine::readyToClose(const Locked& locked) const {
  return failure_.failed() && ledger_.empty(locked) && ledger_.next(locked) >= failure_.failSeq() &&
      failure_.mayClose(Clock::now());
}

void CollectiveEngine::checkDeadlines(Locked& locked) {
  const auto now = Clock::now();
  for (auto& [seq, op] : ledger_.inFlight(locked)) {
    if (now <= op->deadline) {
      continue;
    }
    std::vector<int> waited;
    const std::string message = "fairring: " + std::string(opKindName(op->kind)) + " #" + std::to_string(seq) +
        " (" + describeOp(op->header(0, 0, Route::kWithinMachine)) + ") timed out after " +
        std::to_string(options_.timeout.count()) + " ms on " + layout_.describe(layout_.rank()) + ": " +
        describeWait(*op, waited);
    // The peer it waits for may itself wait for another: name the rank at
    // the end of the chain, without holding the lock (aborts, destroy).
    const uint64_t turn = seq; // the ledger may change meanwhile
    std::string chain;
    locked.unlocked([&] { chain = blame(turn, waited); });
    if (failure_.failed() || life_.is(EngineLife::kShutDown)) {
      return; // another rank's abort came first: its reason stands
    }
    failLocked(message + chain, locked);
    locked.flush();
    return;
  }
}

std::string CollectiveEngine::describeWait(const Operation& op, std::vector<int>& peers) const {
  for (const Slice& slice : op.slices) {
    if (slice.state.is(SliceState::kDone)) {
      continue;
    }
    std::string where = "slice " + std::to_string(slice.index) + " of " + std::to_string(op.slices.size());
    if (slice.state.is(SliceState::kWaitingForSlot)) {
      return where + " is waiting for a staging slot (earlier operations have not finished)";
    }
    for (const Segment& seg : slice.segments) {
      if (seg.state.is(SegmentState::kDone)) {
        continue;
      }
      if (slice.segments.size() > 1) {
        where += ", segment " + std::to_string(seg.index) + " of " + std::to_string(slice.segments.size()) + ",";
      }
      return where + " is " + describeSegmentWait(op, seg, peers);
    }
  }
  return "it is finishing";
}

std::string CollectiveEngine::describeSegmentWait(const Operation& op, const Segment& seg, std::vector<int>& peers)
    const {
  const KindSteps& steps = stepsOf(op);
  const std::string at = std::string(" (step ") + steps.stepName(seg.step) + ")";
  for (int route = 0; route < kNumRoutes; ++route) {
    const Route p = static_cast<Route>(route);
    const bool intraNode = withinMachine(p);
    const size_t pieces = static_cast<size_t>(std::max(1, steps.piecesPer(p)));
    std::string missing;
    const auto& announced = seg.announced[route];
    for (size_t i = 0; i < announced.size(); i += pieces) {
      const int from = static_cast<int>(i / pieces);
      const int peer =
          intraNode ? layout_.rankOf(layout_.machine(), from) : layout_.rankOf(from, layout_.localRank());
      const bool all = std::all_of(announced.begin() + i, announced.begin() + i + pieces, [](char a) { return a != 0; });
      if (peer != layout_.rank() && !all) {
        missing += (missing.empty() ? "" : ", ") + steps.label(p) + " from " + layout_.describe(peer);
        peers.push_back(peer);
      }
    }
    if (!missing.empty()) {
      return "waiting for " + missing + at;
    }
  }
  return "waiting for its sends and receives to complete" + at;
}

} // namespace fairring
