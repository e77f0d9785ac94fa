#pragma once

// The state AllreduceEngine keeps per operation, slice and segment, shared by
// the allreduce's steps (allreduce_engine.cpp) and those of the reduce-scatter
// and all-gather (sharded_steps.cpp). Lives under the engine's lock.

#include <chrono>
#include <functional>
#include <vector>

#include "pipeline/allreduce_engine.h"
#include "pipeline/op_kind.h"
#include "pipeline/sharded_plan.h"

namespace fairring {

constexpr int kNumPhases = 4;

// A phase's timeline stamp: free when the timeline is off (one branch, no
// clock read).
inline void stamp(const Timeline& timeline, int64_t& at) {
  if (timeline.enabled()) {
    at = Timeline::now();
  }
}

// One segment of a slice on its way through its steps.
struct AllreduceEngine::Segment {
  int index{0};
  uint64_t id{0}; // its timeline row
  // Which peers' pieces have been announced, per phase, indexed by
  // from · piecesPer(phase) + piece, where `from` is the sender's local rank
  // (intra-node phases) or machine (rail phases). Empty: a phase the
  // operation's kind does not use.
  std::vector<char> announced[kNumPhases];
  int received[kNumPhases] = {0, 0, 0, 0};
  int pendingReads{0};
  int sendsInFlight{0};
  bool reducing{false};
  bool rsReduced{false}; // all-gather: this rank's part copied into the output
  bool collectSent{false};
  bool shardReduced{false};
  bool diffuseSent{false};
  bool chunkFinal{false}; // all-gather: every part of this rank's rail is here
  bool agSent{false};
  bool done{false};
  std::vector<char> forwarded; // all-gather: local ranks sent the rail's parts
  // Timeline stamps (microseconds), taken only when the timeline is on.
  int64_t tRsReduced{0};
  int64_t tReduceStart{0};
  int64_t tShardReduced{0};
  int64_t tChunkFinal{0};
};

// A slice holds one staging slot for all of its segments: each segment's
// pieces have their own place in it (SlicePlan::chunkOffset, shardOffset;
// ShardedPlan::offsetInSlice). An all-gather slice holds none.
struct AllreduceEngine::Slice {
  int64_t index{0};
  bool active{false};
  int slot{-1};
  uint8_t* staging{nullptr};
  std::vector<Segment> segments;
  int segmentsLeft{0}; // not yet done
  int segmentsStaged{0}; // whose staged pieces are still needed
  bool done{false};
  int64_t tActive{0};
};

struct AllreduceEngine::Op {
  uint64_t seq{0};
  OpKind kind{OpKind::kAllreduce};
  // The allreduce's tensor, or the reduce-scatter's and all-gather's output.
  at::Tensor work;
  at::Tensor input; // reduce-scatter, all-gather; flat and contiguous
  c10d::ReduceOp::RedOpType op{c10d::ReduceOp::SUM};
  SlicePlan plan{0, 1, 1, 1, 1}; // allreduce
  ShardedPlan sharded{0, 1, 1}; // reduce-scatter, all-gather
  size_t elemSize{1};
  int64_t slicesLeft{0};
  std::chrono::steady_clock::time_point deadline;
  c10::intrusive_ptr<Future> future;
  std::vector<at::Tensor> outputs;
  std::function<void()> finish;
  std::vector<Slice> slices;
  int64_t tEnqueued{0};

  bool isAllreduce() const { return kind == OpKind::kAllreduce; }
  int64_t numel() const { return isAllreduce() ? plan.numel() : sharded.partElems(); }

  DataHeader header(int64_t s, int g, Phase phase, int piece = 0) const {
    DataHeader h;
    h.opSeq = seq;
    h.slice = s;
    h.segment = g;
    h.phase = phase;
    h.numel = numel();
    h.dtype = static_cast<int8_t>(work.scalar_type());
    h.op = static_cast<uint8_t>(op);
    h.kind = static_cast<uint8_t>(kind);
    h.piece = piece;
    return h;
  }

  uint8_t* at(Range r) const {
    return static_cast<uint8_t*>(work.data_ptr()) + r.begin * static_cast<int64_t>(elemSize);
  }
  uint8_t* inputAt(Range r) const {
    return static_cast<uint8_t*>(input.data_ptr()) + r.begin * static_cast<int64_t>(elemSize);
  }
};

} // namespace fairring
