// The engine's side of failure: GroupFailure decides (the rules are there);
// this fails the operations it names and sends the aborts it asks for. The
// watchdog (engine_watchdog.cpp) closes the connections when it allows.

#include <c10/util/Exception.h>

#include <algorithm>

#include "faults/plants.h"
#include "ops/reduce_kind.h"
#include "pipeline/collective_engine.h"

namespace fairring {

using Clock = std::chrono::steady_clock;

namespace {
std::exception_ptr makeError(const std::string& message) {
  return std::make_exception_ptr(c10::DistBackendError(message));
}
} // namespace

void CollectiveEngine::failLocked(const std::string& message, Actions& actions, uint64_t fromSeq) {
  if (!failure_.fail(message, fromSeq)) {
    return; // those operations have failed already
  }
  outboxes_.dropFrom(fromSeq);
  if (auto abort = failure_.abortDue(life_.is(EngineLife::kShutDown))) {
    sendAborts(*abort, actions);
  }
  for (auto it = ops_.lower_bound(fromSeq); it != ops_.end();) {
    it->second->state.moveTo(OpState::kFailed);
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
      if (!p.consumed) {
        discard(p.peer, laneOf(p.header.route), p.bytes, actions);
      }
    }
    it = parked_.erase(it);
  }
  cv_.notify_all();
}

void CollectiveEngine::sendAborts(const GroupFailure::Abort& abort, Actions& actions) {
  // On every lane: a peer may hold either one at a message it cannot take yet
  // (parked), and must still learn the reason before it sees this rank close.
  // Ahead of the data queued there: the reason must not wait behind it.
  const std::vector<int> peers = layout_.peers();
  const uint64_t round = failure_.abortsQueued(peers, Clock::now());
  for (int peer : peers) {
    for (int l = 0; l < kNumLanes; ++l) {
      actions.push_back([this, peer, l, abort, round] {
        mesh_->send(
            peer, static_cast<Lane>(l), encode(Abort{abort.reason, abort.fromSeq}), nullptr, 0,
            [this, peer, l, round](Status) {
              const Lane counted =
                  plants::planted(plants::Plant::kCloseWaitsReduceAbort) ? Lane::kReduce : Lane::kGather;
              if (static_cast<Lane>(l) == counted) {
                failure_.abortLeft(peer, round);
              }
              std::lock_guard<std::mutex> lock(mu_);
              cv_.notify_all();
            },
            PeerMesh::Priority::kFirst);
      });
    }
  }
}

void CollectiveEngine::lostPeerLocked(bool needed, const std::string& message, Actions& actions) {
  if (auto now = failure_.peerLost(message, needed)) {
    failLocked(*now, actions);
  }
  cv_.notify_all(); // a ring call that failed waits to name the lost peer (turnFailed)
}

} // namespace fairring
