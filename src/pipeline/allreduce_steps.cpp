// The allreduce's steps (also the barrier's, an allreduce of nothing), per
// segment of a slice, on rank (m, l) of M machines of L ranks:
//
//   at activation: chunk j of the segment to each local rank j (reduce track)
//   1. reduce-scatter  the other local ranks' copies of my chunk are here:
//                      reduce them into mine
//   2. collect         shard m' of my chunk to (m', l), along my rail
//   3. reduce          the other machines' copies of my shard are here:
//                      reduce them into mine (AVG divides, once)
//   4. diffuse         my reduced shard to every machine of my rail
//   5. gather shards   every machine's reduced shard of my chunk is here
//   6. all-gather      my chunk to every local rank
//   7. finish          every chunk is here, every send and read is done
//
// Pieces that are reduced land in the slice's staging slot, results in place
// (landing()). One machine skips 2, 4 and 5; one rank per machine 1 and 6.

#include "ops/reduce_kind.h"
#include "pipeline/steps.h"

namespace fairring {

namespace {

enum Step : uint8_t {
  kReduceScatter,
  kCollect,
  kReduce,
  kDiffuse,
  kGatherShards,
  kAllGather,
  kFinish,
  kNumSteps,
};

class AllreduceSteps final : public KindSteps {
 public:
  using KindSteps::KindSteps;

  int numSteps() const override {
    return kNumSteps;
  }

  const char* stepName(int step) const override {
    static const char* names[kNumSteps] = {"reduce-scatter", "collect",    "reduce", "diffuse",
                                           "gather shards",  "all-gather", "finish"};
    return step < kNumSteps ? names[step] : "done";
  }

  void open(Turn& t) const override {
    for (int k = 1; k < L; ++k) {
      const int j = (l + k) % L;
      sendRange(t, layout_.rankOf(m, j), Route::kWithinMachine, t.op.cuts.chunk(t.slice.index, t.seg.index, j));
    }
  }

  Next run(Turn& t) const override {
    switch (t.seg.step) {
      case kReduceScatter: return reduceScatter(t);
      case kCollect: return collect(t);
      case kReduce: return reduce(t);
      case kDiffuse: return diffuse(t);
      case kGatherShards: return gatherShards(t);
      case kAllGather: return allGather(t);
      case kFinish: return settled(t.seg, Route::kWithinMachineBack, L - 1) ? Next::kDone : Next::kWait;
      default: return Next::kWait;
    }
  }

  std::optional<Landing> landing(const Turn& t, Route route, int from, int piece) const override {
    const SliceCuts& cuts = t.op.cuts;
    const int64_t s = t.slice.index;
    const int g = t.seg.index;
    const int64_t elem = static_cast<int64_t>(t.op.elemSize);
    switch (route) {
      case Route::kWithinMachine: {
        const int64_t at = (from < l ? from : from - 1) * chunkBytes(t.op) + cuts.chunkOffset(g) * elem;
        return Landing{cuts.chunk(s, g, l), t.slice.staging + at};
      }
      case Route::kAlongRail: {
        const int64_t at = shardsAt(t.op) + (from < m ? from : from - 1) * shardBytes(t.op) + cuts.shardOffset(g) * elem;
        return Landing{cuts.shard(s, g, l, m), t.slice.staging + at};
      }
      case Route::kAlongRailBack: {
        const Range range = cuts.shard(s, g, l, from);
        return Landing{range, t.op.at(range)};
      }
      case Route::kWithinMachineBack: {
        const Range range = cuts.chunk(s, g, from);
        return Landing{range, t.op.at(range)};
      }
    }
    return std::nullopt;
  }

  int piecesPer(Route) const override {
    return 1;
  }
  int64_t toEachLocalPeer() const override {
    return 1;
  }
  int64_t toRail() const override {
    return M - 1;
  }

  void record(const Operation& op, const Slice& slice, const Segment& seg, int64_t tDone, const Span& span)
      const override {
    const bool intraNode = L > 1;
    const bool rail = M > 1;
    span("waiting for staging", op.tEnqueued, slice.tActive, true);
    span("reduce-scatter", slice.tActive, seg.stepEnded[kReduceScatter], intraNode);
    span("collect", seg.stepEnded[kReduceScatter], seg.reduceStarted, rail);
    span("reduce", seg.reduceStarted, seg.stepEnded[kReduce], true);
    span("diffuse", seg.stepEnded[kReduce], seg.stepEnded[kGatherShards], rail);
    span("all-gather", seg.stepEnded[kGatherShards], tDone, intraNode);
  }

 private:
  // The staging slot: the L-1 local copies of my chunk of every segment,
  // then the M-1 copies of my shard of every segment.
  static int64_t chunkBytes(const Operation& op) {
    return op.cuts.maxChunkElems() * static_cast<int64_t>(op.elemSize);
  }
  static int64_t shardBytes(const Operation& op) {
    return op.cuts.maxShardElems() * static_cast<int64_t>(op.elemSize);
  }
  int64_t shardsAt(const Operation& op) const {
    return (L - 1) * chunkBytes(op);
  }

  Next reduceScatter(Turn& t) const {
    if (t.seg.got(Route::kWithinMachine) < L - 1) {
      return Next::kWait;
    }
    if (L == 1) {
      return Next::kDone;
    }
    const int64_t elem = static_cast<int64_t>(t.op.elemSize);
    reduceStaged(
        t, t.op.cuts.chunk(t.slice.index, t.seg.index, l),
        t.slice.staging + t.op.cuts.chunkOffset(t.seg.index) * elem, chunkBytes(t.op), L - 1, false);
    return Next::kReducing;
  }

  Next collect(Turn& t) const {
    for (int k = 1; k < M; ++k) {
      const int to = (m + k) % M;
      sendRange(
          t, layout_.rankOf(to, l), Route::kAlongRail, t.op.cuts.shard(t.slice.index, t.seg.index, l, to));
    }
    return Next::kDone;
  }

  Next reduce(Turn& t) const {
    if (t.seg.got(Route::kAlongRail) < M - 1) {
      return Next::kWait;
    }
    const int64_t elem = static_cast<int64_t>(t.op.elemSize);
    reduceStaged(
        t, t.op.cuts.shard(t.slice.index, t.seg.index, l, m),
        t.slice.staging + shardsAt(t.op) + t.op.cuts.shardOffset(t.seg.index) * elem, shardBytes(t.op), M - 1,
        true);
    return Next::kReducing;
  }

  Next diffuse(Turn& t) const {
    // Everything the segment still receives lands in place.
    t.ctx.unstage(t);
    for (int k = 1; k < M; ++k) {
      const int to = (m + k) % M;
      sendRange(
          t, layout_.rankOf(to, l), Route::kAlongRailBack, t.op.cuts.shard(t.slice.index, t.seg.index, l, m));
    }
    return Next::kDone;
  }

  Next gatherShards(Turn& t) const {
    return t.seg.got(Route::kAlongRailBack) < M - 1 ? Next::kWait : Next::kDone;
  }

  Next allGather(Turn& t) const {
    for (int k = 1; k < L; ++k) {
      const int j = (l + k) % L;
      sendRange(t, layout_.rankOf(m, j), Route::kWithinMachineBack, t.op.cuts.chunk(t.slice.index, t.seg.index, l));
    }
    return Next::kDone;
  }

  static void sendRange(Turn& t, int peer, Route route, Range range) {
    t.ctx.send(t, peer, route, 0, t.op.at(range), static_cast<size_t>(range.size()) * t.op.elemSize);
  }

  // Reduces `count` staged pieces, `stride` bytes apart from `first`, into
  // `mine`, in order; the last reduction of the segment also finishes it (AVG).
  void reduceStaged(Turn& t, Range mine, uint8_t* first, int64_t stride, int count, bool last) const {
    at::Tensor dst = t.op.view(mine);
    std::vector<at::Tensor> pieces;
    for (int p = 0; p < count; ++p) {
      pieces.push_back(at::from_blob(first + p * stride, {mine.size()}, t.op.work.options()));
    }
    t.ctx.reduce(t, [dst, pieces, redop = t.op.op, world = layout_.worldSize(), last] {
      for (const auto& piece : pieces) {
        reduceInto(dst, piece, redop);
      }
      if (last) {
        finishReduction(dst, redop, world);
      }
    });
  }
};

} // namespace

std::unique_ptr<KindSteps> allreduceSteps(const RankLayout& layout) {
  return std::make_unique<AllreduceSteps>(layout);
}

} // namespace fairring
