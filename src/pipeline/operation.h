#pragma once

// What the engine keeps per operation, slice and segment, under its lock. The
// steps a segment goes through are its kind's (steps.h); this is their state.

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "common/state.h"
#include "pipeline/announced.h"
#include "pipeline/op_kind.h"
#include "pipeline/sharded_cuts.h"
#include "pipeline/slice_cuts.h"
#include "transport/wire.h"

namespace fairring {

constexpr int kMaxSteps = 8;

// A segment waits with its slice for a slot, then runs its kind's steps one
// after another (`step`); while a step's reduction runs on the reduction
// thread nothing else moves it.
enum class SegmentState : uint8_t {
  kWaiting, // its slice is not active yet
  kStepping, // its current step runs whenever something it may wait for happens
  kReducing, // its step's reduction runs on the reduction thread
  kDone, // past its last step
};
bool allowedMove(SegmentState from, SegmentState to);
const char* stateName(SegmentState s);

// One segment of a slice on its way through its steps.
struct Segment {
  int index{0};
  uint64_t id{0}; // its timeline row
  StateValue<SegmentState> state{SegmentState::kWaiting};
  uint8_t step{0}; // the step it is in (its kind's, see KindSteps::stepName)
  // Which peers' pieces have been announced, per route, indexed by
  // from · piecesPer(route) + piece, where `from` is the sender's local rank
  // (within the machine) or machine (along the rail). Empty: a route the
  // operation's kind does not use.
  std::vector<char> announced[kNumRoutes];
  int received[kNumRoutes] = {0, 0, 0, 0};
  int pendingReads{0};
  int sendsInFlight{0};
  std::vector<char> forwarded; // all-gather: local ranks sent the rail's parts
  // Timeline stamps (microseconds), taken only when the timeline is on: when
  // each step ended, and when the last reduction was posted.
  int64_t stepEnded[kMaxSteps] = {};
  int64_t reduceStarted{0};

  int got(Route route) const {
    return received[static_cast<int>(route)];
  }
};

// A slice takes a staging slot in turn order (or none, for a kind that
// stages nothing) and gives it back once no segment needs its staged pieces,
// usually before its segments are done.
enum class SliceState : uint8_t {
  kWaitingForSlot, // queued: earlier slices hold the slots
  kStaged, // active, holding `slot`
  kActive, // active, holding no slot (given back, or the kind needs none)
  kDone, // every segment done
};
bool allowedMove(SliceState from, SliceState to);
const char* stateName(SliceState s);

// A slice holds one staging slot for all of its segments: each segment's
// pieces have their own place in it (SliceCuts::chunkOffset, shardOffset;
// ShardedCuts::offsetInSlice). An all-gather slice holds none.
struct Slice {
  int64_t index{0};
  StateValue<SliceState> state{SliceState::kWaitingForSlot};
  int slot{-1}; // while kStaged
  uint8_t* staging{nullptr};
  std::vector<Segment> segments;
  int segmentsLeft{0}; // not yet done
  int segmentsStaged{0}; // whose staged pieces are still needed
  int64_t tActive{0};

  bool active() const {
    return state.is(SliceState::kStaged) || state.is(SliceState::kActive);
  }
};

// Where an operation is: posted (the engine's map of operations in flight
// holds it), finished (its result is being handed over), or failed (kept
// until the connections close: a connection may still read or write its
// memory).
enum class OpState : uint8_t {
  kPosted,
  kFinished,
  kFailed,
};
bool allowedMove(OpState from, OpState to);
const char* stateName(OpState s);

struct Operation {
  using Future = c10::ivalue::Future;

  uint64_t seq{0}; // its turn: the same on every rank
  StateValue<OpState> state{OpState::kPosted};
  OpKind kind{OpKind::kAllreduce};
  // A call handed to Gloo, announced at its turn (CollectiveEngine::announce):
  // what it is travels in the headers while the operation itself moves nothing.
  std::optional<Announced> announced;
  // The allreduce's tensor, or the reduce-scatter's and all-gather's output.
  at::Tensor work;
  at::Tensor input; // reduce-scatter, all-gather; flat and contiguous
  c10d::ReduceOp::RedOpType op{c10d::ReduceOp::SUM};
  SliceCuts cuts{0, 1, 1, 1, 1}; // allreduce, barrier
  ShardedCuts sharded{0, 1, 1}; // reduce-scatter, all-gather
  size_t elemSize{1};
  int64_t slicesLeft{0};
  std::chrono::steady_clock::time_point deadline;
  bool waitsNoted{false}; // its wait has been written to the store (engine_blame.cpp)
  c10::intrusive_ptr<Future> future;
  std::vector<at::Tensor> outputs;
  std::function<void()> finish;
  std::vector<Slice> slices;
  int64_t tEnqueued{0};

  bool sliced() const {
    return kind == OpKind::kAllreduce || kind == OpKind::kBarrier || kind == OpKind::kAnnounce;
  }
  int64_t numel() const {
    return sliced() ? cuts.numel() : sharded.partElems();
  }

  DataHeader header(int64_t s, int g, Route route, int piece = 0) const {
    DataHeader h;
    h.opSeq = seq;
    h.slice = s;
    h.segment = g;
    h.route = route;
    h.numel = announced ? announced->numel : numel();
    h.dtype = static_cast<int8_t>(work.scalar_type());
    h.op = static_cast<uint8_t>(op);
    h.kind = static_cast<uint8_t>(kind);
    h.piece = piece;
    if (announced) {
      h.call = static_cast<uint8_t>(announced->call);
      h.root = announced->root;
    }
    return h;
  }

  uint8_t* at(Range r) const {
    return static_cast<uint8_t*>(work.data_ptr()) + r.begin * static_cast<int64_t>(elemSize);
  }
  uint8_t* inputAt(Range r) const {
    return static_cast<uint8_t*>(input.data_ptr()) + r.begin * static_cast<int64_t>(elemSize);
  }
  at::Tensor view(Range r) const {
    return work.slice(0, r.begin, r.end);
  }
};

} // namespace fairring
