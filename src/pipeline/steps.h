#pragma once

// The steps a segment goes through, one set per collective: the allreduce's
// (allreduce_steps.cpp, also the barrier's), the reduce-scatter's
// (reduce_scatter_steps.cpp) and the all-gather's (all_gather_steps.cpp).
// Each step is a named state with a function of its own; the engine runs a
// segment's current step whenever something it may wait for has happened (a
// message arrived, was read or sent, a reduction returned) and moves it on as
// the step says. Every message lands where its kind says (landing()).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pipeline/engine_lock.h"
#include "pipeline/operation.h"
#include "topology/rank_layout.h"

namespace fairring {

class StepContext;

// What one step works on, under the engine's lock; I/O it decides is queued
// on `locked`, issued after the lock is released.
struct Turn {
  Operation& op;
  Slice& slice;
  Segment& seg;
  StepContext& ctx;
  Locked& locked;
};

// What the engine does for a step.
class StepContext {
 public:
  virtual ~StepContext() = default;
  // Queues a message of the segment to `peer` (Outboxes keeps the order).
  virtual void send(Turn& t, int peer, Route route, int piece, uint8_t* data, size_t bytes) = 0;
  // Runs `task` on the reduction thread; the step ends when it returns.
  virtual void reduce(Turn& t, std::function<void()> task) = 0;
  // This segment no longer needs its slice's staged pieces; the slot is
  // released once no segment of the slice does.
  virtual void unstage(Turn& t) = 0;
};

enum class Next : uint8_t {
  kWait, // what the step needs has not happened yet: run it again later
  kDone, // the step is over: on to the next
  kReducing, // it posted a reduction: the step is over when that returns
};

// Where a message's body goes.
struct Landing {
  Range range; // in elements of the operation's tensor (for the size check)
  uint8_t* dst;
};

class KindSteps {
 public:
  explicit KindSteps(const RankLayout& layout)
      : layout_(layout),
        L(layout.localSize()),
        M(layout.numMachines()),
        l(layout.localRank()),
        m(layout.machine()) {}
  virtual ~KindSteps() = default;

  virtual int numSteps() const = 0;
  virtual const char* stepName(int step) const = 0;
  // At activation, per segment: the sends that wait for nothing.
  virtual void open(Turn& t) const = 0;
  // Runs the segment's current step (t.seg.step).
  virtual Next run(Turn& t) const = 0;
  // Where a `route` message from `from` (a local rank for intra-node routes,
  // a machine for rail routes), piece `piece`, lands; nullopt if this kind
  // sends no such message.
  virtual std::optional<Landing> landing(const Turn& t, Route route, int from, int piece) const = 0;
  // Pieces one peer sends per segment in `route` (0: the kind has no such route).
  virtual int piecesPer(Route route) const = 0;
  // Reduce-track messages queued per segment to each local peer, and to the
  // rail (all rail peers together): what SendOrder is told at admission.
  virtual int64_t toEachLocalPeer() const = 0;
  virtual int64_t toRail() const = 0;
  // Whether a slice holds a staging slot.
  virtual bool staged() const {
    return true;
  }
  // Whether its slices activate in the global slot order (which keeps
  // reduce-track messages in order); a kind that sends nothing on the reduce
  // track and stages nothing starts at admission.
  virtual bool activatesInOrder() const {
    return true;
  }
  // What a message on `route` is called in errors: by default the
  // allreduce's exchange on it (its four steps that move data use the four
  // routes); a kind whose messages are something else names its own.
  virtual std::string label(Route route) const {
    switch (route) {
      case Route::kWithinMachine: return "reduce-scatter";
      case Route::kAlongRail: return "collect";
      case Route::kAlongRailBack: return "diffuse";
      case Route::kWithinMachineBack: return "all-gather";
    }
    return "unknown route";
  }
  using Span = std::function<void(const char* name, int64_t begin, int64_t end, bool shown)>;
  // The segment's spans on the timeline, `tDone` when it finished.
  virtual void record(const Operation& op, const Slice& slice, const Segment& seg, int64_t tDone, const Span& span)
      const = 0;

 protected:
  // Whether every message the segment waits for has arrived and been read,
  // and everything it sent has left.
  static bool settled(const Segment& seg, Route route, int expected) {
    return seg.got(route) >= expected && seg.sendsInFlight == 0 && seg.pendingReads == 0;
  }

  const RankLayout& layout_;
  const int L; // ranks per machine
  const int M; // machines
  const int l; // this rank's local rank (its rail)
  const int m; // this rank's machine
};

std::unique_ptr<KindSteps> allreduceSteps(const RankLayout& layout);
std::unique_ptr<KindSteps> reduceScatterSteps(const RankLayout& layout);
std::unique_ptr<KindSteps> allGatherSteps(const RankLayout& layout);
std::unique_ptr<KindSteps> announceSteps(const RankLayout& layout);

} // namespace fairring
