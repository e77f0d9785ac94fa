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

void CollectiveEngine::failLocked(const std::string& message, Locked& locked, uint64_t fromSeq) {
  if (!failure_.fail(message, fromSeq)) {
    return; // those operations have failed already
  }
  outboxes_.dropFrom(fromSeq);
  if (auto abort = failure_.abortDue(life_.is(EngineLife::kShutDown))) {
    sendAborts(*abort, locked);
  }
  for (Operation* op : ledger_.bury(fromSeq, locked)) {
    op->state.moveTo(OpState::kFailed);
    locked.later([future = op->future, message] { future->setError(makeError(message)); });
  }
  for (auto& fail : outside_.takeFrom(fromSeq, locked)) {
    locked.later([fail = std::move(fail), message] { fail(message); });
  }
  for (const Parked& p : inbox_.dropFrom(fromSeq, locked)) {
    discard(p.peer, trackOf(p.header.route), p.bytes, locked);
  }
  cv_.notify_all();
}

void CollectiveEngine::sendAborts(const GroupFailure::Abort& abort, Locked& locked) {
  // On every track: a peer may hold either one at a message it cannot take yet
  // (parked), and must still learn the reason before it sees this rank close.
  // Ahead of the data queued there: the reason must not wait behind it.
  const std::vector<int> peers = layout_.peers();
  const uint64_t round = failure_.abortsQueued(peers, Clock::now());
  for (int peer : peers) {
    for (int l = 0; l < kNumTracks; ++l) {
      locked.later([this, peer, l, abort, round] {
        mesh_->send(
            peer, static_cast<Track>(l), encode(Abort{abort.reason, abort.fromSeq}), nullptr, 0,
            [this, peer, l, round](Status) {
              const Track counted =
                  plants::planted(plants::Plant::kCloseWaitsReduceAbort) ? Track::kReduce : Track::kGather;
              if (static_cast<Track>(l) == counted) {
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

void CollectiveEngine::lostPeerLocked(bool needed, const std::string& message, Locked& locked) {
  if (auto now = failure_.peerLost(message, needed)) {
    failLocked(*now, locked);
  }
  cv_.notify_all(); // a ring call that failed waits to name the lost peer (turnFailed)
}

} // namespace fairring
