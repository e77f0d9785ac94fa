#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "pipeline/op_kind.h"
#include "pipeline/send_order.h"
#include "pipeline/slice_plan.h"
#include "pipeline/task_queue.h"
#include "staging/staging_pool.h"
#include "timeline/timeline.h"
#include "topology/rank_layout.h"
#include "transport/peer_mesh.h"
#include "transport/wire.h"

namespace fairring {

struct EngineOptions {
  size_t sliceBytes;
  size_t totalMemory;
  std::chrono::milliseconds timeout;
  std::string listenAddress;
  std::string token;
  std::string timelinePath; // empty: no timeline
  size_t chunkBytes; // FAIRRING_PIPELINE_CHUNK: each local rank's part of a segment
};

// The reduction-server allreduce on CPU tensors. Every operation is cut into
// slices, each holding one staging slot, and slices into segments; each
// segment goes through reduce-scatter (inside the machine), collect + reduce
// + diffuse (along the rail, across machines) and all-gather (inside the
// machine), segments of a slice overlapping one another. Slices of many
// operations are in flight at once, bounded by the staging pool.
class AllreduceEngine {
 public:
  using Future = c10::ivalue::Future;

  AllreduceEngine(RankLayout layout, EngineOptions options);
  ~AllreduceEngine();

  // Connects to the peers; throws with a clear message on failure.
  void start(c10d::Store& store);

  // Reduces `work` (contiguous) in place across all ranks. `outputs` is the
  // future's value; `finish` runs (on the reduction thread) once `work` holds
  // the result and before the future completes, e.g. to copy it back into a
  // non-contiguous tensor. Throws at once on bad input or a broken engine.
  // The future completes on an engine thread: its callbacks must only hand
  // the result on (the backend gives users futures of OrderedCompletion).
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

  // Refuses the operation this rank was about to issue, on every rank: the
  // peers cannot know that it will never come, so the group fails from that
  // turn on, with `message` (naming this rank) as the reason everywhere.
  // Earlier operations finish. Always throws.
  [[noreturn]] void refuse(const std::string& message);

  // Fails what is in flight, closes the connections and joins the threads.
  void shutdown();

  // Shuts down every engine of this process. Called at interpreter exit: once
  // Python finalizes, a core thread that drops the last reference to a
  // Python-owned tensor takes the GIL and CPython aborts the process. The
  // Python wrappers of backends do not live that long, so the registry is here.
  // At exit, operations already posted get up to `grace` to finish first, as
  // Gloo's destructor lets queued work finish: ranks leave at different
  // moments, and the first to go must not fail what the others still run.
  static void shutdownAll(std::chrono::milliseconds grace);

  const RankLayout& layout() const { return layout_; }

 private:
  struct Segment;
  struct Slice;
  struct Op;
  struct Parked {
    int peer;
    DataHeader header;
    size_t bytes;
  };
  struct Outgoing {
    std::string header;
    void* data;
    size_t bytes;
    uint64_t seq;
    int64_t slice;
    int segment;
    int peer;
  };
  // Messages to one local peer on one lane, or to all rail peers on one lane
  // (which share a writer, see PeerMesh). The deadlock argument needs each
  // pipe (and each rail writer) to carry reduce messages in global order of
  // operations and slices (SendOrder); decisions are made under the lock, but
  // the sends happen after it on whichever thread made them, so one drainer
  // at a time issues them in queue order. A reduce-lane queue is kept sorted
  // by operation, and its front waits while SendOrder holds it.
  struct Outbox {
    std::deque<Outgoing> queue;
    bool draining{false};
  };
  using Actions = std::vector<std::function<void()>>;

  std::unique_ptr<Op> newOp(
      OpKind kind,
      at::Tensor work,
      c10d::ReduceOp::RedOpType op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish,
      const c10::intrusive_ptr<Future>& future);
  // Posts `o` (its plan set), or throws the group's failure.
  void admit(std::unique_ptr<Op> o);
  void admitLocked(std::unique_ptr<Op> o, Actions& actions);
  void onMessage(int peer, Lane lane, Status status, std::string header, size_t bytes);
  void deliver(Op& op, Slice& slice, int peer, const DataHeader& h, size_t bytes, Actions& actions);
  void onReceived(uint64_t seq, int64_t s, int g, Phase phase, Status status);
  // How many pieces one peer sends per segment in `phase` (see Segment::announced).
  int piecesPer(const Op& op, Phase phase) const;
  std::string phaseLabel(const Op& op, Phase phase) const;
  void onSent(uint64_t seq, int64_t s, int g, int peer, Status status);

  void pump(Actions& actions);
  void activate(Op& op, Slice& slice, Actions& actions);
  void advance(Op& op, Slice& slice, Segment& seg, Actions& actions);
  void sendPiece(Op& op, Slice& slice, Segment& seg, int peer, Phase phase, Range range, Actions& actions);
  void sendBytes(
      Op& op,
      Slice& slice,
      Segment& seg,
      int peer,
      Phase phase,
      int piece,
      uint8_t* data,
      size_t bytes,
      Actions& actions);
  // Runs `task` on the reduction thread, then `then` and advance() under the lock.
  void reduceTask(
      Op& op,
      Slice& slice,
      Segment& seg,
      std::function<void()> task,
      std::function<void(Slice&, Segment&, Actions&)> then);

  // The reduce-scatter's and all-gather's steps (sharded_steps.cpp).
  void openSharded(Op& op, Slice& slice, Actions& actions);
  void advanceReduceScatter(Op& op, Slice& slice, Segment& seg, Actions& actions);
  void advanceAllGather(Op& op, Slice& slice, Segment& seg, Actions& actions);
  // Where a reduce-scatter's or all-gather's message lands: false if its
  // kind has no such phase.
  bool shardedTarget(
      const Op& op,
      const Slice& slice,
      const Segment& seg,
      Phase phase,
      int from,
      int piece,
      Range& range,
      uint8_t*& dst) const;
  at::Tensor stagedPiece(const Op& op, const Slice& slice, const Segment& seg, int index) const;
  void finishSegment(Op& op, Slice& slice, Segment& seg, Actions& actions);
  void finishSlice(Op& op, Slice& slice, Actions& actions);
  // The outbox key of messages to `peer`: the peer, or kRailPeers.
  int outboxOf(int peer) const;
  void drain(int box, Lane lane);
  // Announces to sendOrder_ the reduce-lane messages `op` will send.
  void expectSends(const Op& op);
  // Reduces `numPieces` staged pieces into `mine` on the reduction thread
  // (and applies AVG's division if `last`), then runs `then` under the lock.
  void reduceLater(
      Op& op,
      Slice& slice,
      Segment& seg,
      Range mine,
      uint8_t* firstPiece,
      int64_t pieceStride,
      int numPieces,
      bool last,
      std::function<void(Slice&, Segment&, Actions&)> then);

  // Records the failure (the first one is what later calls report), fails
  // every operation from `fromSeq` on, tells the peers, and lets the
  // watchdog close the connections once no earlier operation is left.
  // Must be called with mu_ held.
  void failLocked(const std::string& message, Actions& actions, uint64_t fromSeq = 0);
  void queueAbortsLocked(const std::string& message, uint64_t fromSeq, Actions& actions);
  // A peer this rank still needs is gone: fail, or, while the group is healthy, fail
  // after kCloseGrace unless an abort brings the reason first.
  void lostPeerLocked(const std::string& message, Actions& actions);
  // Reads and drops the body of a message for an operation that failed, so
  // that what queues behind it on the pipe still arrives.
  void discard(int peer, Lane lane, size_t bytes, Actions& actions);
  // Whether an operation in flight still waits for a message on (peer, lane).
  bool needsFrom(int peer, Lane lane) const;
  void run(Actions& actions);
  void watchdog();
  std::string describeWait(const Op& op) const;
  std::string describeOp(const DataHeader& h) const;
  bool sameOp(const Op& op, const DataHeader& h) const;
  std::string describeMismatch(const Op& op, int peer, const DataHeader& h) const;

  at::Tensor view(const Op& op, Range range) const;
  void recordSegment(const Op& op, const Slice& slice, const Segment& seg);
  void recordOp(const Op& op);

  const RankLayout layout_;
  const EngineOptions options_;
  Timeline timeline_;
  std::unique_ptr<PeerMesh> mesh_;
  TaskQueue tasks_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string failure_; // empty while healthy
  uint64_t failSeq_{UINT64_MAX}; // operations from here on have failed
  // A peer whose connection closed while nothing in flight needed it: not yet
  // an error, but the next operation (which needs every peer) fails with it.
  std::string departed_;
  // A peer closed a connection this rank still needs, before any abort said why: the
  // group fails with that close only after a short grace (the watchdog), in case the
  // reason is on its way from another peer (a rank that refused a call and destroyed
  // the group at once reaches some ranks only through others).
  std::string closedBeforeReason_;
  std::chrono::steady_clock::time_point closedAt_;
  bool meshStarted_{false}; // every connection to every peer exists
  bool meshClosed_{false};
  int abortsInFlight_{0};
  std::chrono::steady_clock::time_point failedAt_;
  bool stopping_{false};
  uint64_t nextSeq_{0};
  uint64_t nextSegmentId_{0}; // timeline rows
  std::map<uint64_t, std::unique_ptr<Op>> ops_;
  // Failed operations whose memory a connection may still read or write
  // until the connections are closed.
  std::vector<std::unique_ptr<Op>> graveyard_;
  std::deque<std::pair<uint64_t, int64_t>> waitingForSlot_;
  std::map<std::pair<uint64_t, int64_t>, std::vector<Parked>> parked_;
  static constexpr int kRailPeers = -1;
  std::map<std::pair<int, Lane>, Outbox> outboxes_;
  SendOrder sendOrder_;
  StagingPool staging_;
  std::thread watchdog_;
};

} // namespace fairring
