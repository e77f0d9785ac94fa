// The reduce-scatter's steps (docs/design.md, "Reduce-scatter and
// all-gather"), per segment, on rank (m, l); "part r" is rank r's range of
// the input, W parts in all:
//
//   at activation: to each local rank j, the parts of the M ranks of rail j
//                  (reduce track; the header's piece says which machine's)
//   1. reduce machine  the other local ranks' copies are here: reduce, in
//                      local-rank order, this machine's copies of each part
//                      of rail l: my own part's into the output, each other
//                      machine's into the first staged copy
//   2. send partials   to each (m', l), this machine's partial sum of its part
//   3. reduce rail     the other machines' partial sums are here: reduce them,
//                      in machine order, into the output (AVG divides, once)
//   4. finish          every send and read is done: the slot is free (the
//                      partial sums were sent from it)
//
// Every output element is reduced by one rank in a fixed order: the same bits
// every run.

#include "ops/reduce_kind.h"
#include "pipeline/steps.h"

namespace fairring {

namespace {

enum Step : uint8_t {
  kReduceMachine,
  kSendPartials,
  kReduceRail,
  kFinish,
  kNumSteps,
};

// dst = copyFrom (if given), then dst = dst (op) piece for each piece, in order.
struct Reduction {
  at::Tensor dst;
  at::Tensor copyFrom;
  std::vector<at::Tensor> pieces;
};

void runReductions(const std::vector<Reduction>& reductions, c10d::ReduceOp::RedOpType op) {
  for (const Reduction& r : reductions) {
    if (r.copyFrom.defined() && r.copyFrom.data_ptr() != r.dst.data_ptr()) {
      r.dst.copy_(r.copyFrom);
    }
    for (const at::Tensor& piece : r.pieces) {
      reduceInto(r.dst, piece, op);
    }
  }
}

class ReduceScatterSteps final : public KindSteps {
 public:
  using KindSteps::KindSteps;

  int numSteps() const override {
    return kNumSteps;
  }

  const char* stepName(int step) const override {
    static const char* names[kNumSteps] = {"reduce machine", "send partials", "reduce rail", "finish"};
    return step < kNumSteps ? names[step] : "done";
  }

  void open(Turn& t) const override {
    const Range mine = t.op.sharded.segment(t.slice.index, t.seg.index);
    const size_t bytes = static_cast<size_t>(mine.size()) * t.op.elemSize;
    for (int k = 1; k < L; ++k) {
      const int j = (l + k) % L;
      for (int mm = 0; mm < M; ++mm) {
        const Range part = t.op.sharded.ofRank(layout_.rankOf(mm, j), mine);
        t.ctx.send(t, layout_.rankOf(m, j), Route::kWithinMachine, mm, t.op.inputAt(part), bytes);
      }
    }
  }

  Next run(Turn& t) const override {
    switch (t.seg.step) {
      case kReduceMachine: return reduceMachine(t);
      case kSendPartials: return sendPartials(t);
      case kReduceRail: return reduceRail(t);
      case kFinish: return finish(t);
      default: return Next::kWait;
    }
  }

  std::optional<Landing> landing(const Turn& t, Route route, int from, int piece) const override {
    int index = 0;
    if (route == Route::kWithinMachine) {
      index = (from < l ? from : from - 1) * M + piece;
    } else if (route == Route::kAlongRail) {
      index = (L - 1) * M + (from < m ? from : from - 1);
    } else {
      return std::nullopt;
    }
    return Landing{mine(t), static_cast<uint8_t*>(staged(t, index).data_ptr())};
  }

  int piecesPer(Route route) const override {
    switch (route) {
      case Route::kWithinMachine: return M;
      case Route::kAlongRail: return 1;
      default: return 0;
    }
  }
  int64_t toEachLocalPeer() const override {
    return M;
  }
  int64_t toRail() const override {
    return M - 1;
  }

  void record(const Operation& op, const Slice& slice, const Segment& seg, int64_t, const Span& span)
      const override {
    span("waiting for staging", op.tEnqueued, slice.tActive, true);
    span("reduce-scatter", slice.tActive, seg.stepEnded[kReduceMachine], L > 1);
    span("collect", seg.stepEnded[kReduceMachine], seg.reduceStarted, M > 1);
    span("reduce", seg.reduceStarted, seg.stepEnded[kReduceRail], true);
  }

 private:
  static Range mine(const Turn& t) {
    return t.op.sharded.segment(t.slice.index, t.seg.index);
  }

  // Staged piece `index` of the segment: the slot holds (L-1)·M local copies,
  // then M-1 partial sums, each a slice's range of one part.
  static at::Tensor staged(const Turn& t, int index) {
    const Range range = mine(t);
    const int64_t offset = index * t.op.sharded.sliceElems() + t.op.sharded.offsetInSlice(t.slice.index, t.seg.index);
    return at::from_blob(
        t.slice.staging + offset * static_cast<int64_t>(t.op.elemSize), {range.size()}, t.op.work.options());
  }

  at::Tensor inputPart(const Turn& t, int machine) const {
    const Range part = t.op.sharded.ofRank(layout_.rankOf(machine, l), mine(t));
    return t.op.input.slice(0, part.begin, part.end);
  }

  Next reduceMachine(Turn& t) const {
    if (t.seg.got(Route::kWithinMachine) < (L - 1) * M) {
      return Next::kWait;
    }
    // With one local rank the partial sums are sent straight from the input.
    std::vector<Reduction> reductions;
    for (int mm = 0; mm < M; ++mm) {
      std::vector<at::Tensor> copies;
      for (int j = 0; j < L - 1; ++j) {
        copies.push_back(staged(t, j * M + mm));
      }
      if (mm == m) {
        reductions.push_back(Reduction{t.op.view(mine(t)), inputPart(t, mm), copies});
      } else if (L > 1) {
        std::vector<at::Tensor> pieces{inputPart(t, mm)};
        pieces.insert(pieces.end(), copies.begin() + 1, copies.end());
        reductions.push_back(Reduction{copies.front(), at::Tensor(), pieces});
      }
    }
    t.ctx.reduce(t, [reductions, redop = t.op.op] { runReductions(reductions, redop); });
    return Next::kReducing;
  }

  Next sendPartials(Turn& t) const {
    const size_t bytes = static_cast<size_t>(mine(t).size()) * t.op.elemSize;
    for (int k = 1; k < M; ++k) {
      const int to = (m + k) % M;
      const at::Tensor partial = L > 1 ? staged(t, to) : inputPart(t, to);
      t.ctx.send(t, layout_.rankOf(to, l), Route::kAlongRail, 0, static_cast<uint8_t*>(partial.data_ptr()), bytes);
    }
    return Next::kDone;
  }

  Next reduceRail(Turn& t) const {
    if (t.seg.got(Route::kAlongRail) < M - 1) {
      return Next::kWait;
    }
    std::vector<at::Tensor> partials;
    for (int i = 0; i < M - 1; ++i) {
      partials.push_back(staged(t, (L - 1) * M + i));
    }
    t.ctx.reduce(t, [output = t.op.view(mine(t)), partials, redop = t.op.op, world = layout_.worldSize()] {
      runReductions({Reduction{output, at::Tensor(), partials}}, redop);
      finishReduction(output, redop, world);
    });
    return Next::kReducing;
  }

  Next finish(Turn& t) const {
    if (t.seg.sendsInFlight > 0 || t.seg.pendingReads > 0) {
      return Next::kWait;
    }
    t.ctx.unstage(t);
    return Next::kDone;
  }
};

} // namespace

std::unique_ptr<KindSteps> reduceScatterSteps(const RankLayout& layout) {
  return std::make_unique<ReduceScatterSteps>(layout);
}

} // namespace fairring
