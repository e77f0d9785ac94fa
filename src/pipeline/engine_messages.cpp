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

void CollectiveEngine::onMessage(int peer, Lane lane, Status status, std::string header, size_t bytes) {
  const std::optional<Abort> abort = status.ok() ? decodeAbort(header) : std::nullopt;
  if (abort) {
    faults::hit(faults::kEngineAbort, peer); // outside the lock: a delay here holds only this connection
  } else if (!status.ok()) {
    faults::hit(faults::kEngineLost, peer);
  }
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!life_.is(EngineLife::kOpen)) {
      return;
    }
    if (!status.ok()) {
      closeRead(peer, lane, status.message(), actions);
    } else if (abort) {
      failLocked(
          GroupFailure::forwarded(abort->reason, layout_.describe(layout_.rank()), layout_.describe(peer)), actions,
          abort->fromSeq);
      if (lane == Lane::kGather) {
        // Operations before the failed turn may still need its reduce lane, now closed.
        gatherEnded(peer, actions);
      }
      // Finish reading it: earlier operations' messages queue behind it.
      discard(peer, lane, bytes, actions);
    } else if (auto h = decodeData(header); !h || laneOf(h->route) != lane) {
      failLocked("fairring: malformed message from " + layout_.describe(peer), actions);
    } else {
      onData(peer, lane, *h, bytes, actions);
    }
  }
  run(actions);
}

void CollectiveEngine::closeRead(int peer, Lane lane, const std::string& message, Actions& actions) {
  // A reduce-lane close read first waits for the gather lane, which carries the
  // peer's abort if it failed on purpose (PeerCloses); the watchdog bounds it.
  if (lane == Lane::kReduce && !closes_.gatherEnded(peer) &&
      !plants::planted(plants::Plant::kReduceCloseNotHeld)) {
    closes_.holdReduceClose(peer, message, Clock::now());
    return;
  }
  // A peer that finished everything may close before we have read its last
  // bytes' successors; that is only an error if we wait on it.
  lostPeerLocked(needsFrom(peer, lane), message, actions);
  if (lane == Lane::kGather) {
    gatherEnded(peer, actions);
  }
}

void CollectiveEngine::gatherEnded(int peer, Actions& actions) {
  if (auto held = closes_.endGather(peer)) {
    lostPeerLocked(needsFrom(peer, Lane::kReduce), *held, actions);
  }
}

void CollectiveEngine::onData(int peer, Lane lane, const DataHeader& h, size_t bytes, Actions& actions) {
  if (failure_.fails(h.opSeq)) {
    discard(peer, lane, bytes, actions);
    return;
  }
  auto it = ops_.find(h.opSeq);
  if (it != ops_.end()) {
    Operation& op = *it->second;
    if (!sameOp(op, h)) {
      failLocked(describeMismatch(op, peer, h), actions, op.seq);
    } else if (!op.slices[h.slice].active()) {
      park(peer, lane, h, bytes, actions);
    } else {
      deliver(op, op.slices[h.slice], peer, h, bytes, actions);
    }
  } else if (h.opSeq < nextSeq_) {
    failLocked(
        "fairring: " + callName(h) + " #" + std::to_string(h.opSeq) +
            " differs between ranks: " + layout_.describe(peer) + " sent " + describeOp(h) +
            " but it has already finished on " + layout_.describe(layout_.rank()) + " (with fewer elements)",
        actions, h.opSeq);
  } else {
    // The peer is ahead of us; the connection waits until we post this
    // operation (but for a message with no body: park()).
    park(peer, lane, h, bytes, actions);
  }
}

void CollectiveEngine::park(int peer, Lane lane, const DataHeader& h, size_t bytes, Actions& actions) {
  Parked parked{peer, h, bytes};
  // The gather lane never stops reading at a message (the results of earlier
  // operations may come behind it), so one with no body (an announcement of
  // a call this rank has not made yet) is read now and kept until its turn.
  if (bytes == 0 && lane == Lane::kGather && !plants::planted(plants::Plant::kAnnouncementParked)) {
    parked.consumed = true;
    actions.push_back([this, peer, lane] {
      mesh_->receive(peer, lane, nullptr, 0, [](const Status&) {}); // a lost connection is told apart
    });
  }
  parked_[{h.opSeq, h.slice}].push_back(std::move(parked));
}

void CollectiveEngine::deliver(
    Operation& op,
    Slice& slice,
    int peer,
    const DataHeader& h,
    size_t bytes,
    Actions& actions,
    bool consumed) {
  if (!sameOp(op, h)) {
    failLocked(describeMismatch(op, peer, h), actions, op.seq);
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
  Turn t{op, slice, seg, *this, actions};
  std::optional<Landing> landing;
  if (samePlace && peer != layout_.rank() && h.piece >= 0 && h.piece < pieces &&
      index < seg.announced[route].size() && !seg.announced[route][index]) {
    landing = steps.landing(t, h.route, from, h.piece);
  }
  if (!landing) {
    failLocked(
        "fairring: unexpected " + steps.label(h.route) + " message from " + layout_.describe(peer) + " for " +
            opKindName(op.kind) + " #" + std::to_string(op.seq),
        actions);
    return;
  }
  const size_t expected = static_cast<size_t>(landing->range.size()) * op.elemSize;
  if (bytes != expected) {
    failLocked(
        "fairring: " + layout_.describe(peer) + " sent " + std::to_string(bytes) + " bytes for the " +
            steps.label(h.route) + " of " + opKindName(op.kind) + " #" + std::to_string(op.seq) + " where " +
            std::to_string(expected) + " were expected",
        actions);
    return;
  }
  seg.announced[route][index] = 1;
  ++seg.pendingReads;
  if (consumed) {
    actions.push_back([this, p = h.route, seq = op.seq, s = h.slice, g = h.segment] {
      onReceived(seq, s, g, p, Status());
    });
    return;
  }
  actions.push_back([this, peer, p = h.route, dst = landing->dst, bytes, seq = op.seq, s = h.slice, g = h.segment] {
    mesh_->receive(peer, laneOf(p), dst, bytes, [this, seq, s, g, p](Status status) {
      onReceived(seq, s, g, p, std::move(status));
    });
  });
}

void CollectiveEngine::onReceived(uint64_t seq, int64_t s, int g, Route route, Status status) {
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!life_.is(EngineLife::kOpen)) {
      return;
    }
    if (!status.ok()) {
      // A body this rank was reading: needed.
      lostPeerLocked(true, status.message(), actions);
    } else if (auto it = ops_.find(seq); it != ops_.end()) {
      Slice& slice = it->second->slices[s];
      Turn t{*it->second, slice, slice.segments[g], *this, actions};
      --t.seg.pendingReads;
      ++t.seg.received[static_cast<int>(route)];
      advance(t);
    }
  }
  run(actions);
}

void CollectiveEngine::onSent(uint64_t seq, int64_t s, int g, int peer, Status status) {
  Actions actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!life_.is(EngineLife::kOpen)) {
      return;
    }
    // A failed send does not make this rank's result wrong: only data it still
    // has to receive can. (A peer that finished and exited may drop the
    // acknowledgement of bytes it did read from its memory.) So the send
    // counts as over, and the peer as lost, needed only if work waits on it.
    if (!status.ok()) {
      lostPeerLocked(needsFrom(peer, Lane::kReduce) || needsFrom(peer, Lane::kGather), status.message(), actions);
    }
    // An operation that failed is gone from ops_; earlier ones carry on.
    if (auto it = ops_.find(seq); it != ops_.end()) {
      Slice& slice = it->second->slices[s];
      Turn t{*it->second, slice, slice.segments[g], *this, actions};
      --t.seg.sendsInFlight;
      advance(t);
    }
  }
  run(actions);
}

void CollectiveEngine::discard(int peer, Lane lane, size_t bytes, Actions& actions) {
  actions.push_back([this, peer, lane, bytes] { mesh_->receive(peer, lane, nullptr, bytes, [](Status) {}); });
}

bool CollectiveEngine::needsFrom(int peer, Lane lane) const {
  const bool local = layout_.machineOf(peer) == layout_.machine();
  const Route route = local ? (lane == Lane::kReduce ? Route::kWithinMachine : Route::kWithinMachineBack)
                            : (lane == Lane::kReduce ? Route::kAlongRail : Route::kAlongRailBack);
  for (const auto& [seq, op] : ops_) {
    for (const Slice& slice : op->slices) {
      for (const Segment& seg : slice.segments) {
        if (segmentNeeds(*op, slice, seg, peer, route)) {
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
    Route route) const {
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
  auto parked = parked_.find({op.seq, slice.index});
  return parked == parked_.end() ||
      std::none_of(parked->second.begin(), parked->second.end(), [&](const Parked& p) {
           return p.peer == peer && p.header.route == route && p.header.segment == seg.index;
         });
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
