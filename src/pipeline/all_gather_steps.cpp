// The all-gather's steps, per segment, on rank (m, l); "part r" is rank r's
// range of the output, W parts in all. Nothing is staged: every message lands
// in the output, so its slices take no slot (they still activate in the
// global slot order, which keeps their reduce-track messages in order).
//
//   at activation: my part to each (m', l) (reduce track), and an empty
//                  "ready" to each local rank (reduce track)
//   1. copy own      my own part into the output (nothing where in place)
//   2. gather rail   the M parts of rail l are here
//   3. forward       to each local rank that is ready, those M parts (gather
//                    track); waits for the ranks not ready yet
//   4. finish        every part of the other rails is here, every send and
//                    read is done
//
// The "ready" is what makes step 3 safe on the gather track, which must never
// carry a message the receiver has not posted the operation for (a receiver
// stops reading a connection at such a message; docs/design.md, "Tracks").

#include "ops/reduce_kind.h"
#include "pipeline/steps.h"

namespace fairring {

namespace {

enum Step : uint8_t {
  kCopyOwn,
  kGatherRail,
  kForward,
  kFinish,
  kNumSteps,
};

class AllGatherSteps final : public KindSteps {
 public:
  using KindSteps::KindSteps;

  int numSteps() const override {
    return kNumSteps;
  }

  const char* stepName(int step) const override {
    static const char* names[kNumSteps] = {"copy own part", "gather rail", "forward", "finish"};
    return step < kNumSteps ? names[step] : "done";
  }

  void open(Turn& t) const override {
    const Range mine = t.op.sharded.segment(t.slice.index, t.seg.index);
    const size_t bytes = static_cast<size_t>(mine.size()) * t.op.elemSize;
    for (int k = 1; k < M; ++k) {
      t.ctx.send(t, layout_.rankOf((m + k) % M, l), Route::kAlongRail, 0, t.op.inputAt(mine), bytes);
    }
    for (int k = 1; k < L; ++k) {
      t.ctx.send(t, layout_.rankOf(m, (l + k) % L), Route::kWithinMachine, 0, nullptr, 0);
    }
  }

  Next run(Turn& t) const override {
    switch (t.seg.step) {
      case kCopyOwn: return copyOwn(t);
      case kGatherRail: return t.seg.got(Route::kAlongRail) < M - 1 ? Next::kWait : Next::kDone;
      case kForward: return forward(t);
      case kFinish: return settled(t.seg, Route::kWithinMachineBack, (L - 1) * M) ? Next::kDone : Next::kWait;
      default: return Next::kWait;
    }
  }

  std::optional<Landing> landing(const Turn& t, Route route, int from, int piece) const override {
    const Range mine = t.op.sharded.segment(t.slice.index, t.seg.index);
    Range range;
    switch (route) {
      case Route::kWithinMachine: return Landing{Range{0, 0}, nullptr}; // ready: no body
      case Route::kAlongRail: range = t.op.sharded.ofRank(layout_.rankOf(from, l), mine); break;
      case Route::kWithinMachineBack: range = t.op.sharded.ofRank(layout_.rankOf(piece, from), mine); break;
      default: return std::nullopt;
    }
    return Landing{range, t.op.at(range)};
  }

  int piecesPer(Route route) const override {
    switch (route) {
      case Route::kWithinMachine: return 1;
      case Route::kAlongRail: return 1;
      case Route::kWithinMachineBack: return M;
      default: return 0;
    }
  }
  int64_t toEachLocalPeer() const override {
    return 1;
  }
  int64_t toRail() const override {
    return M - 1;
  }
  bool staged() const override {
    return false;
  }
  std::string label(Route route) const override {
    switch (route) {
      case Route::kWithinMachine: return "ready";
      case Route::kAlongRail: return "rail gather";
      default: return KindSteps::label(route);
    }
  }

  void record(const Operation& op, const Slice& slice, const Segment& seg, int64_t tDone, const Span& span)
      const override {
    span("waiting for its turn", op.tEnqueued, slice.tActive, true);
    span("rail gather", slice.tActive, seg.stepEnded[kGatherRail], M > 1);
    span("all-gather", seg.stepEnded[kGatherRail], tDone, L > 1);
  }

 private:
  Next copyOwn(Turn& t) const {
    const Range mine = t.op.sharded.segment(t.slice.index, t.seg.index);
    const Range own = t.op.sharded.ofRank(layout_.rank(), mine);
    t.ctx.reduce(t, [dst = t.op.view(own), src = t.op.input.slice(0, mine.begin, mine.end)] {
      if (src.data_ptr() != dst.data_ptr()) {
        dst.copy_(src);
      }
    });
    return Next::kReducing;
  }

  Next forward(Turn& t) const {
    const Range mine = t.op.sharded.segment(t.slice.index, t.seg.index);
    const size_t bytes = static_cast<size_t>(mine.size()) * t.op.elemSize;
    bool waiting = false;
    for (int k = 1; k < L; ++k) {
      const int j = (l + k) % L;
      if (t.seg.forwarded[j]) {
        continue;
      }
      if (!t.seg.announced[static_cast<int>(Route::kWithinMachine)][j]) {
        waiting = true; // not ready: it may not have posted this operation yet
        continue;
      }
      t.seg.forwarded[j] = 1;
      for (int mm = 0; mm < M; ++mm) {
        uint8_t* part = mm == m ? t.op.inputAt(mine) : t.op.at(t.op.sharded.ofRank(layout_.rankOf(mm, l), mine));
        t.ctx.send(t, layout_.rankOf(m, j), Route::kWithinMachineBack, mm, part, bytes);
      }
    }
    return waiting ? Next::kWait : Next::kDone;
  }
};

} // namespace

std::unique_ptr<KindSteps> allGatherSteps(const RankLayout& layout) {
  return std::make_unique<AllGatherSteps>(layout);
}

} // namespace fairring
