#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <array>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/state.h"
#include "common/status.h"
#include "failure/group_failure.h"
#include "failure/peer_closes.h"
#include "pipeline/delegated_calls.h"
#include "pipeline/engine_life.h"
#include "pipeline/engine_lock.h"
#include "pipeline/inbox.h"
#include "pipeline/operation.h"
#include "pipeline/outboxes.h"
#include "pipeline/outside_turns.h"
#include "pipeline/steps.h"
#include "pipeline/task_queue.h"
#include "pipeline/turn_ledger.h"
#include "timeline/timeline.h"
#include "topology/rank_layout.h"
#include "transport/peer_mesh.h"
#include "transport/wire.h"

namespace fairring {

// What the Python layer decided (fairring_pg/config.py owns every rule and
// default; the engine is handed the numbers).
struct EngineOptions {
  size_t sliceBytes{0};
  size_t slotBytes{0}; // one staging slot (fairring_pg.sizing.staging_slot_bytes)
  size_t totalMemory{0};
  std::chrono::milliseconds timeout{0};
  // What is left of the group's start for connecting to the peers (0: the timeout).
  std::chrono::milliseconds startTimeout{0};
  std::string listenAddress;
  std::string token;
  std::string timelinePath; // empty: no timeline
  size_t chunkBytes{0}; // FAIRRING_PIPELINE_CHUNK: each local rank's part of a segment
  std::string railCongestion; // FAIRRING_RAIL_CONGESTION; empty or "system": the system's
};

// The reduction-server collectives on CPU tensors. Every operation is cut
// into slices, each holding one staging slot, and slices into segments; each
// segment goes through its kind's steps (steps.h: the allreduce's
// reduce-scatter, collect, reduce, diffuse and all-gather; the reduce-scatter's
// and all-gather's halves of them), segments of a slice overlapping one
// another. Slices of many operations are in flight at once, bounded by the
// staging pool. Every operation takes a turn (its sequence number), the same
// on every rank; what a failure does is GroupFailure's.
class CollectiveEngine : private StepContext {
 public:
  using Future = c10::ivalue::Future;

  CollectiveEngine(RankLayout layout, EngineOptions options);
  ~CollectiveEngine() override;

  // Connects to the peers; throws with a clear message on failure, or if
  // shutdown() comes first (it interrupts the wait), or `giveUp` gives a reason.
  void start(const c10::intrusive_ptr<c10d::Store>& store, PeerMesh::GiveUp giveUp = {});

  // Reduces `work` (contiguous) in place across all ranks. `outputs` is the
  // future's value; `finish` runs (on the reduction thread) once `work` holds
  // the result and before the future completes, e.g. to copy it back into a
  // non-contiguous tensor. Throws at once on bad input, or if the group has
  // failed at or before this call's turn. The future completes on an engine
  // thread: its callbacks must only hand the result on (the backend gives
  // users futures of OrderedCompletion).
  c10::intrusive_ptr<Future> enqueue(
      at::Tensor work,
      c10d::ReduceOp::RedOpType op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish);

  // Reduce-scatter (input: W parts, output: this rank's part) or all-gather
  // (input: this rank's part, output: W parts) of flat contiguous tensors of
  // one dtype; `op` is ignored by the all-gather. As enqueue otherwise.
  // Sizes that break that shape are refused with refuse().
  c10::intrusive_ptr<Future> enqueueSharded(
      OpKind kind,
      at::Tensor input,
      at::Tensor output,
      c10d::ReduceOp::RedOpType op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish);

  // An operation that completes once every rank has posted it, or fails on
  // every rank if the group failed at or before its turn.
  c10::intrusive_ptr<Future> barrier();

  // Refuses the operation this rank was about to issue, on every rank: the
  // peers cannot know that it will never come, so the group fails from that
  // turn on, with `message` (naming this rank) as the reason everywhere.
  // Earlier operations finish. Always throws.
  [[noreturn]] void refuse(const std::string& message);

  // The group's collectives on its delegate, which the wait chain counts.
  const std::shared_ptr<DelegatedCalls>& delegatedCalls() const {
    return delegated_;
  }

  // A call handed to Gloo (an allreduce on the ring, or a collective fairring
  // does not run: announced.h) takes its turn here as an announcement
  // (OpKind::kAnnounce: what it is in one empty message to each local and
  // rail peer, no slot, one hop, started at once, not behind earlier slices):
  // ranks that disagree, or a rank that runs an engine collective at that
  // turn, fail there naming both sides, where Gloo would reduce whatever it
  // is given or end the process on a size that differs. The future completes
  // once this rank's machine and rail peers announced the same call (so no
  // two ranks hand Gloo different calls: announce_steps.cpp), and fails
  // wherever the group fails at or before its turn. Throws the group's
  // failure if that turn has failed already; `seq` is the turn.
  c10::intrusive_ptr<Future> announce(const Announced& what, uint64_t& seq);
  // The call at turn `seq` runs outside the engine now (on Gloo's ring):
  // `fail` runs (on an engine thread, or here if that turn has failed already)
  // if the group fails at or before it before turnDone() or turnFailed().
  void watchTurn(uint64_t seq, std::function<void(const std::string&)> fail);
  void turnDone(uint64_t seq);
  // The ring call at turn `seq` failed: the group fails from there on. Returns
  // what the call should raise: `message`, with the lost peer named where one
  // closed its connections to this rank (waiting up to
  // GroupFailure::kSendFailureWait for that close: Gloo names it by address).
  std::string turnFailed(uint64_t seq, const std::string& message);

  const GroupFailure& failure() const {
    return failure_;
  }

  // Fails what is in flight, closes the connections (once the aborts are out,
  // at most GroupFailure::kAbortGrace after they were queued) and joins the
  // threads. Idempotent.
  void shutdown();

  // Shuts down every engine of this process. Called at interpreter exit: once
  // Python finalizes, a core thread that drops the last reference to a
  // Python-owned tensor takes the GIL and CPython aborts the process. The
  // Python wrappers of backends do not live that long, so the registry is here.
  // At exit, operations already posted get up to `grace` to finish first, as
  // Gloo's destructor lets queued work finish: ranks leave at different
  // moments, and the first to go must not fail what the others still run.
  static void shutdownAll(std::chrono::milliseconds grace);

  const RankLayout& layout() const {
    return layout_;
  }

 private:
  // Admission (engine_admission.cpp).
  std::unique_ptr<Operation> newOp(
      OpKind kind,
      at::Tensor work,
      c10d::ReduceOp::RedOpType op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish,
      const c10::intrusive_ptr<Future>& future);
  // Posts `o` (its plan set) at the next turn, which it returns, or throws the
  // group's failure.
  uint64_t admit(std::unique_ptr<Operation> o);
  void admitLocked(std::unique_ptr<Operation> o, Locked& locked);
  void layOut(Operation& op);
  int64_t shardedSliceElems(OpKind kind, const at::Tensor& input, int64_t partElems, const std::string& where);

  // Progress (collective_engine.cpp): slots, then each segment's steps.
  const KindSteps& stepsOf(const Operation& op) const {
    return *steps_[static_cast<int>(op.kind)];
  }
  void pump(Locked& locked);
  // Moves the slice to `state` (kStaged or kActive) and starts its segments.
  void activate(Operation& op, Slice& slice, SliceState state, Locked& locked);
  void deliverParked(Operation& op, Slice& slice, Locked& locked);
  void advance(Turn& t);
  void endStep(Turn& t);
  void finishSegment(Turn& t);
  void finishOperation(Operation& op, Locked& locked);
  void complete(std::shared_ptr<Operation> finished, Locked& locked);
  // StepContext.
  void send(Turn& t, int peer, Route route, int piece, uint8_t* data, size_t bytes) override;
  void reduce(Turn& t, std::function<void()> task) override;
  void unstage(Turn& t) override;
  void drain(int key, Track track);

  // Messages (engine_messages.cpp).
  void onMessage(int peer, Track track, Status status, std::string header, size_t bytes);
  // A connection from `peer` read as closed (PeerCloses holds a reduce-track one).
  void closeRead(int peer, Track track, const std::string& message, Locked& locked);
  // `peer`'s gather track ended (its abort or its close): act on its held reduce-track close.
  void gatherEnded(int peer, Locked& locked);
  void onData(int peer, Track track, const DataHeader& h, size_t bytes, Locked& locked);
  void deliver(
      Operation& op,
      Slice& slice,
      int peer,
      const DataHeader& h,
      size_t bytes,
      Locked& locked,
      bool consumed = false);
  // Parks a message whose operation (or slice) is not active yet.
  void park(int peer, Track track, const DataHeader& h, size_t bytes, Locked& locked);
  void onReceived(uint64_t seq, int64_t s, int g, Route route, Status status);
  void onSent(uint64_t seq, int64_t s, int g, int peer, Status status);
  // Reads and drops the body of a message for an operation that failed, so
  // that what queues behind it on the connection still arrives.
  void discard(int peer, Track track, size_t bytes, Locked& locked);
  // Whether an operation in flight still waits for a message on (peer, track).
  bool needsFrom(int peer, Track track, const Locked& locked) const;
  bool segmentNeeds(
      const Operation& op,
      const Slice& slice,
      const Segment& seg,
      int peer,
      Route route,
      const Locked& locked) const;
  std::string describeOp(const DataHeader& h) const;
  bool sameOp(const Operation& op, const DataHeader& h) const;
  std::string describeMismatch(const Operation& op, int peer, const DataHeader& h) const;

  // Failure (engine_failure.cpp): GroupFailure decides, these carry it out.
  void failLocked(const std::string& message, Locked& locked, uint64_t fromSeq = 0);
  void sendAborts(const GroupFailure::Abort& abort, Locked& locked);
  // A peer is gone; `needed`: an operation in flight waits on it.
  void lostPeerLocked(bool needed, const std::string& message, Locked& locked);

  // The watchdog (engine_watchdog.cpp).
  void watchdog();
  // Whether a failed group's connections may close now: no operation before
  // the failed turn is left (a slower rank may not have posted them yet) and
  // the aborts are out (closing earlier would drop them).
  bool readyToClose(const Locked& locked) const;
  void checkDeadlines(Locked& locked);
  // A reduce-track close held past GroupFailure::kSendFailureWait is acted on,
  // or past kAbortGrace while the gather track's reader is still behind.
  void actOnHeldCloses(Locked& locked);
  // What the operation waits for, and the ranks it waits for (none where it
  // waits for a slot, or for its own sends).
  std::string describeWait(const Operation& op, std::vector<int>& peers) const;
  std::string describeSegmentWait(const Operation& op, const Segment& seg, std::vector<int>& peers) const;

  // The wait chain (engine_blame.cpp): an operation that has waited half
  // the timeout notes whom it waits for in the store; one that timed out
  // follows the notes to a rank that wrote none, and names it (blame, called
  // holding no lock).
  void noteLongWaits(const Locked& locked);
  void note(uint64_t seq, std::vector<int> waited);
  std::string blame(uint64_t seq, const std::vector<int>& waited);

  // The timeline (engine_timeline.cpp).
  void recordSegment(const Operation& op, const Slice& slice, const Segment& seg);
  void recordOp(const Operation& op);

  // Every engine of the process, for shutdownAll (engine_shutdown.cpp).
  static void enlist(CollectiveEngine* engine);

  const RankLayout layout_;
  const EngineOptions options_;
  Timeline timeline_;
  std::unique_ptr<PeerMesh> mesh_;
  c10::intrusive_ptr<c10d::Store> store_; // set by start(); the wait chain's
  const std::shared_ptr<DelegatedCalls> delegated_ = std::make_shared<DelegatedCalls>();
  TaskQueue tasks_;
  std::array<std::unique_ptr<KindSteps>, 5> steps_; // by OpKind
  GroupFailure failure_;
  PeerCloses closes_; // guarded by mu_

  mutable std::mutex mu_;
  std::condition_variable cv_;
  StateValue<EngineLife> life_{EngineLife::kOpen};
  uint64_t nextSegmentId_{0}; // timeline rows
  // The parts, each with its rules (its header), all under mu_.
  TurnLedger ledger_; // turns, operations in flight, slots, the buried
  Inbox inbox_; // messages that came before their slice started
  OutsideTurns outside_; // calls on Gloo's ring at their turn
  Outboxes outboxes_; // what each connection sends next, in turn order
  std::thread watchdog_;
};

} // namespace fairring
