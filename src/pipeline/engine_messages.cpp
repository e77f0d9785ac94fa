// What arrives: every message's header is checked against this rank's own
// view of its operation, then its body is read straight to where the step
// that waits for it wants it (KindSteps::landing), or parked until its
// operation is posted and its slice has a slot. Sends coming back are
// counted here too.

#include <c10/util/Exception.h>

#include <algorithm>

#include "faults/fault_points.h"
#include "faults/plants.h"
#include "ops/reduce_kind.h"
#include "pipeline/collective_engine.h"

namespace fairring {

namespace {
// The collective a header is part of, as torch names it.
std::string callName(const DataHeader& h) {
  const auto kind = static_cast<OpKind>(h.kind);
  return kind == OpKind::kAnnounce ? announcedName(static_cast<AnnouncedCall>(h.call)) : opKindName(kind);
}
} // namespace

using RedOp = c10d::ReduceOp::RedOpType;

void CollectiveEngine::onMessage(int peer, Track track, Status status, std::string header, size_t bytes) {
  const std::optional<Abort> abort = status.ok() ? decodeAbort(header) : std::nullopt;
  if (abort) {
    faults::hit(faults::kEngineAbort, peer); // outside the lock: a delay here holds only this connection
  } else if (!status.ok()) {
    faults::hit(faults::kEngineLost, peer);
  }
  std::unique_lock<std::mutex> lock(mu_);
  Locked locked(lock);
  if (!life_.is(EngineLife::kOpen)) {
    return;
  }
  if (!status.ok()) {
    closeRead(peer, track, status.message(), locked);
  } else if (abort) {
    failLocked(
        GroupFailure::forwarded(abort->reason, layout_.describe(layout_.rank()), layout_.describe(peer)), locked,
        abort->fromSeq);
    if (track == Track::kGather) {
      // Operations before the failed turn may still need its reduce track, now closed.
      gatherEnded(peer, locked);
    }
    // Finish reading it: earlier operations' messages queue behind it.
    discard(peer, track, bytes, locked);
  } else if (auto h = decodeData(header); !h || trackOf(h->route) != track) {
    failLocked("fairring: malformed message from " + layout_.describe(peer), locked);
  } else {
    onData(peer, track, *h, bytes, locked);
  }
  locked.release();
}

void CollectiveEngine::closeRead(int peer, Track track, const std::string& message, Locked& locked) {
  // A reduce-track close read first waits for the gather track, which carries the
  // peer's abort if it failed on purpose (PeerCloses); the watchdog bounds it.
  if (track == Track::kReduce && !closes_.gatherEnded(peer) &&
      !plants::planted(plants::Plant::kReduceCloseNotHeld)) {
    closes_.holdReduceClose(peer, message, Clock::now());
    return;
  }
  // A peer that finished everything may close before we have read its last
  // bytes' successors; that is only an error if we wait on it.
  lostPeerLocked(needsFrom(peer, track, locked), message, locked);
  if (track == Track::kGather) {
    gatherEnded(peer, locked);
  }
}

void CollectiveEngine::gatherEnded(int peer, Locked& locked) {
  if (auto held = closes_.endGather(peer)) {
    lostPeerLocked(needsFrom(peer, Track::kReduce, locked), *held, locked);
  }
}

void CollectiveEngine::onData(int peer, Track track, const DataHeader& h, size_t bytes, Locked& locked) {
  if (failure_.fails(h.opSeq)) {
    discard(peer, track, bytes, locked);
    return;
  }
  if (Operation* found = ledger_.find(h.opSeq, locked)) {
    Operation& op = *found;
    if (!sameOp(op, h)) {
      failLocked(describeMismatch(op, peer, h), locked, op.seq);
    } else if (!op.slices[h.slice].active()) {
      park(peer, track, h, bytes, locked);
    } else {
      deliver(op, op.slices[h.slice], peer, h, bytes, locked);
    }
  } else if (h.opSeq < ledger_.next(locked)) {
    failLocked(
        "fairring: " + callName(h) + " #" + std::to_string(h.opSeq) +
            " differs between ranks: " + layout_.describe(peer) + " sent " + describeOp(h) +
            " but it has already finished on " + layout_.describe(layout_.rank()) + " (with fewer elements)",
        locked, h.opSeq);
  } else {
    // The peer is ahead of us; the connection waits until we post this
    // operation (but for a message with no body: park()).
    park(peer, track, h, bytes, locked);
  }
}

void CollectiveEngine::park(int peer, Track track, const DataHeader& h, size_t bytes, Locked& locked) {
  Parked parked{peer, h, bytes};
  // The gather track never stops reading at a message (the results of earlier
  // operations may come behind it), so one with no body (an announcement of
  // a call this rank has not made yet) is read now and kept until its turn.
  if (bytes == 0 && track == Track::kGather && !plants::planted(plants::Plant::kAnnouncementParked)) {
    parked.consumed = true;
    locked.later([this, peer, track] {
      mesh_->receive(peer, track, nullptr, 0, [](const Status&) {}); // a lost connection is told apart
    });
  }
  inbox_.park(std::move(parked), locked);
}

void CollectiveEngine::deliver(
    Operation& op,
    Slice& slice,
    int peer,
    const DataHeader& h,
    size_t bytes,
    Locked& locked,
    bool consumed) {
  if (!sameOp(op, h)) {
    failLocked(describeMismatch(op, peer, h), locked, op.seq);
    return;
  }
  const KindSteps& steps = stepsOf(op);
  const bool intraNode = withinMachine(h.route);
  const bool samePlace = intraNode ? layout_.machineOf(peer) == layout_.machine()
                                   : layout_.localRankOf(peer) == layout_.localRank();
  const int from = intraNode ? layout_.localRankOf(peer) : layout_.machineOf(peer);
  const int route = static_cast<int>(h.route);
  const int pieces = steps.piecesPer(h.route);
  Segment& seg = slice.segments[h.segment];
  const size_t index = static_cast<size_t>(from) * pieces + h.piece;
  Turn t{op, slice, seg, *this, locked};
  std::optional<Landing> landing;
  if (samePlace && peer != layout_.rank() && h.piece >= 0 && h.piece < pieces &&
      index < seg.announced[route].size() && !seg.announced[route][index]) {
    landing = steps.landing(t, h.route, from, h.piece);
  }
  if (!landing) {
    failLocked(
        "fairring: unexpected " + steps.label(h.route) + " message from " + layout_.describe(peer) + " for " +
            opKindName(op.kind) + " #" + std::to_string(op.seq),
        locked);
    return;
  }
  const size_t expected = static_cast<size_t>(landing->range.size()) * op.elemSize;
  if (bytes != expected) {
    failLocked(
        "fairring: " + layout_.describe(peer) + " sent " + std::to_string(bytes) + " bytes for the " +
            steps.label(h.route) + " of " + opKindName(op.kind) + " #" + std::to_string(op.seq) + " where " +
            std::to_string(expected) + " were expected",
        locked);
    return;
  }
  seg.announced[route][index] = 1;
  ++seg.pendingReads;
  if (consumed) {
    locked.later([this, p = h.route, seq = op.seq, s = h.slice, g = h.segment] {
      onReceived(seq, s, g, p, Status());
    });
    return;
  }
  locked.later([this, peer, p = h.route, dst = landing->dst, bytes, seq = op.seq, s = h.slice, g = h.segment] {
    mesh_->receive(peer, trackOf(p), dst, bytes, [this, seq, s, g, p](Status status) {
      onReceived(seq, s, g, p, std::move(status));
    });
  });
}

void CollectiveEngine::onReceived(uint64_t seq, int64_t s, int g, Route route, Status status) {
  std::unique_lock<std::mutex> lock(mu_);
  Locked locked(lock);
  if (!life_.is(EngineLife::kOpen)) {
    return;
  }
  if (!status.ok()) {
    // A body this rank was reading: needed.
    lostPeerLocked(true, status.message(), locked);
  } else if (Operation* op = ledger_.find(seq, locked)) {
    Slice& slice = op->slices[s];
    Turn t{*op, slice, slice.segments[g], *this, locked};
    --t.seg.pendingReads;
    ++t.seg.received[static_cast<int>(route)];
    advance(t);
  }
  locked.release();
}

void CollectiveEngine::onSent(uint64_t seq, int64_t s, int g, int peer, Status status) {
  std::unique_lock<std::mutex> lock(mu_);
  Locked locked(lock);
  if (!life_.is(EngineLife::kOpen)) {
    return;
  }
  // A failed send does not make this rank's result wrong: only data it still
  // has to receive can. (A peer that finished and exited may drop the
  // acknowledgement of bytes it did read from its memory.) So the send
  // counts as over, and the peer as lost, needed only if work waits on it.
  if (!status.ok()) {
    const bool needed = needsFrom(peer, Track::kReduce, locked) || needsFrom(peer, Track::kGather, locked);
    lostPeerLocked(needed, status.message(), locked);
  }
  // An operation that failed is out of the ledger; earlier ones carry on.
  if (Operation* op = ledger_.find(seq, locked)) {
    Slice& slice = op->slices[s];
    Turn t{*op, slice, slice.segments[g], *this, locked};
    --t.seg.sendsInFlight;
    advance(t);
  }
  locked.release();
}

void CollectiveEngine::discard(int peer, Track track, size_t bytes, Locked& locked) {
  locked.later([this, peer, track, bytes] { mesh_->receive(peer, track, nullptr, bytes, [](Status) {}); });
}

bool CollectiveEngine::needsFrom(int peer, Track track, const Locked& locked) const {
  const bool local = layout_.machineOf(peer) == layout_.machine();
  const Route route = local ? (track == Track::kReduce ? Route::kWithinMachine : Route::kWithinMachineBack)
                            : (track == Track::kReduce ? Route::kAlongRail : Route::kAlongRailBack);
  for (const auto& [seq, op] : ledger_.inFlight(locked)) {
    for (const Slice& slice : op->slices) {
      for (const Segment& seg : slice.segments) {
        if (segmentNeeds(*op, slice, seg, peer, route, locked)) {
          return true;
        }
      }
    }
  }
  return false;
}

bool CollectiveEngine::segmentNeeds(
    const Operation& op,
    const Slice& slice,
    const Segment& seg,
    int peer,
    Route route,
    const Locked& locked) const {
  const bool local = layout_.machineOf(peer) == layout_.machine();
  const int from = local ? layout_.localRankOf(peer) : layout_.machineOf(peer);
  const size_t pieces = static_cast<size_t>(stepsOf(op).piecesPer(route));
  const auto& announced = seg.announced[static_cast<int>(route)];
  const auto first = announced.begin() + std::min(announced.size(), from * pieces);
  const auto last = announced.begin() + std::min(announced.size(), (from + 1) * pieces);
  if (seg.state.is(SegmentState::kDone) || std::all_of(first, last, [](char a) { return a != 0; })) {
    return false;
  }
  // What a peer sent that waits for this rank's slot is already here.
  return !inbox_.holds(op.seq, slice.index, seg.index, peer, route, locked);
}

std::string CollectiveEngine::describeOp(const DataHeader& h) const {
  const auto kind = static_cast<OpKind>(h.kind);
  const bool announced = kind == OpKind::kAnnounce;
  const auto call = static_cast<AnnouncedCall>(h.call);
  const bool allreduce = kind == OpKind::kAllreduce;
  const std::string what = allreduce ? "" : callName(h) + " of ";
  const bool whole = allreduce || kind == OpKind::kBarrier || announced;
  const std::string perRank = whole ? "" : " per rank";
  const bool reduces = announced ? announcedReduces(call) : kind != OpKind::kAllGather;
  const std::string reduction = reduces ? " with ReduceOp." + opName(static_cast<RedOp>(h.op)) : "";
  const std::string size = h.numel >= 0 ? std::to_string(h.numel) + " elements" + perRank + " of " : "";
  const std::string root = announced && h.root >= 0 ? " rooted at rank " + std::to_string(h.root) : "";
  return what + size + dtypeName(static_cast<at::ScalarType>(h.dtype)) + reduction + root;
}

bool CollectiveEngine::sameOp(const Operation& op, const DataHeader& h) const {
  const DataHeader mine = op.header(0, 0, h.route);
  return h.numel == mine.numel && h.dtype == mine.dtype && h.op == mine.op && h.kind == mine.kind &&
      h.call == mine.call && h.root == mine.root && h.slice >= 0 &&
      h.slice < static_cast<int64_t>(op.slices.size()) && h.segment >= 0 &&
      h.segment < static_cast<int32_t>(op.slices[h.slice].segments.size());
}

std::string CollectiveEngine::describeMismatch(const Operation& op, int peer, const DataHeader& h) const {
  const DataHeader mine = op.header(0, 0, h.route);
  return "fairring: " + callName(mine) + " #" + std::to_string(op.seq) + " differs between ranks: " +
      layout_.describe(layout_.rank()) + " has " + describeOp(mine) + ", " + layout_.describe(peer) + " has " +
      describeOp(h);
}

} // namespace fairring
