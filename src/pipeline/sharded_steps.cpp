// The reduce-scatter and the all-gather on the engine's slices, segments,
// staging, lanes and failure handling (docs/design.md, "Reduce-scatter and
// all-gather"). Rank (m, l); "part r" is rank r's range of the big tensor.
//
// Reduce-scatter, per segment:
//   1. to each local rank j: the parts of the M ranks of rail j (reduce lane);
//   2. reduce, per machine mm, this machine's copies of part (mm, l): into
//      the output for mm = m, into the staging slot otherwise;
//   3. to each (mm, l): this machine's partial sum of its part (reduce lane);
//   4. reduce the M - 1 partial sums received into the output (AVG divides).
// All-gather, per segment (no staging: everything lands in the output):
//   1. my part to each (mm, l) (reduce lane), and "ready" to each local rank;
//   2. once the M parts of rail l are here, to each local rank that is
//      ready: those M parts (gather lane).
// The "ready" is what makes step 2 safe on the gather lane, which must never
// carry a message the receiver has not posted the operation for (a receiver
// stops reading a connection at such a message; docs/design.md, "Lanes").

#include <c10/util/Exception.h>

#include "ops/reduce_kind.h"
#include "pipeline/engine_state.h"

namespace fairring {

c10::intrusive_ptr<AllreduceEngine::Future> AllreduceEngine::enqueueSharded(
    OpKind kind,
    at::Tensor input,
    at::Tensor output,
    c10d::ReduceOp::RedOpType op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish) {
  const int W = layout_.worldSize();
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  const std::string where = std::string("fairring: ") + opKindName(kind) + " on " + layout_.describe(layout_.rank());
  if (kind == OpKind::kReduceScatter) {
    const Status reducible = checkReducible(op, input.scalar_type());
    if (!reducible.ok()) {
      throw c10::DistBackendError(reducible.message());
    }
  } else {
    op = c10d::ReduceOp::SUM; // not used; equal on every rank for the header check
  }
  if (input.scalar_type() != output.scalar_type()) {
    refuse(where + ": the input has dtype " + dtypeName(input.scalar_type()) + " but the output has " +
           dtypeName(output.scalar_type()));
  }
  const at::Tensor& big = kind == OpKind::kReduceScatter ? input : output;
  const at::Tensor& part = kind == OpKind::kReduceScatter ? output : input;
  if (big.numel() != part.numel() * W) {
    refuse(where + ": the " + (kind == OpKind::kReduceScatter ? "input" : "output") + " has " +
           std::to_string(big.numel()) + " elements, expected the world size (" + std::to_string(W) + ") x the " +
           (kind == OpKind::kReduceScatter ? "output" : "input") + "'s " + std::to_string(part.numel()) + " = " +
           std::to_string(part.numel() * W));
  }
  const int64_t elem = static_cast<int64_t>(part.element_size());
  // A reduce-scatter slice of k elements per part stages (L-1)·M + M-1
  // pieces of k: k = slice / W fits the slot an allreduce slice uses.
  const int64_t staged = static_cast<int64_t>(L - 1) * M + (M - 1);
  int64_t sliceElems = std::max<int64_t>(1, static_cast<int64_t>(options_.sliceBytes) / elem / W);
  if (kind == OpKind::kReduceScatter && staged > 0) {
    sliceElems = std::min<int64_t>(sliceElems, static_cast<int64_t>(staging_.slotBytes()) / (elem * staged));
    if (sliceElems == 0) {
      refuse(where + ": FAIRRING_SLICE_SIZE=" + std::to_string(options_.sliceBytes) +
             " is too small for a reduce_scatter of " + dtypeName(input.scalar_type()) + " at world size " +
             std::to_string(W));
    }
  }
  // Each local rank moves about FAIRRING_PIPELINE_CHUNK per segment in the
  // intra-node step (M parts); one machine has no link to overlap.
  const int64_t segmentElems =
      M > 1 ? std::max<int64_t>(1, static_cast<int64_t>(options_.chunkBytes) / elem / M) : sliceElems;
  auto future = c10::make_intrusive<Future>(c10::ListType::create(c10::TensorType::get()));
  auto o = newOp(kind, output.view({-1}), op, std::move(outputs), std::move(finish), future);
  o->input = input.view({-1});
  o->sharded = ShardedPlan(part.numel(), sliceElems, segmentElems);
  admit(std::move(o));
  return future;
}

at::Tensor AllreduceEngine::stagedPiece(const Op& op, const Slice& slice, const Segment& seg, int index) const {
  const Range range = op.sharded.segment(slice.index, seg.index);
  const int64_t offset = index * op.sharded.sliceElems() + op.sharded.offsetInSlice(slice.index, seg.index);
  return at::from_blob(
      slice.staging + offset * static_cast<int64_t>(op.elemSize), {range.size()}, op.work.options());
}

bool AllreduceEngine::shardedTarget(
    const Op& op,
    const Slice& slice,
    const Segment& seg,
    Phase phase,
    int from,
    int piece,
    Range& range,
    uint8_t*& dst) const {
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  const int l = layout_.localRank();
  const int m = layout_.machine();
  const Range mine = op.sharded.segment(slice.index, seg.index);
  if (op.kind == OpKind::kReduceScatter) {
    int index = 0;
    if (phase == Phase::kReduceScatter) {
      index = (from < l ? from : from - 1) * M + piece;
    } else if (phase == Phase::kCollect) {
      index = (L - 1) * M + (from < m ? from : from - 1);
    } else {
      return false;
    }
    range = mine;
    dst = static_cast<uint8_t*>(stagedPiece(op, slice, seg, index).data_ptr());
    return true;
  }
  switch (phase) {
    case Phase::kReduceScatter: // ready: no body
      range = {0, 0};
      dst = nullptr;
      return true;
    case Phase::kCollect:
      range = op.sharded.ofRank(layout_.rankOf(from, l), mine);
      break;
    case Phase::kAllGather:
      range = op.sharded.ofRank(layout_.rankOf(piece, from), mine);
      break;
    default: return false;
  }
  dst = op.at(range);
  return true;
}

void AllreduceEngine::openSharded(Op& op, Slice& slice, Actions& actions) {
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  const int l = layout_.localRank();
  const int m = layout_.machine();
  const size_t elem = op.elemSize;
  for (Segment& seg : slice.segments) {
    const Range mine = op.sharded.segment(slice.index, seg.index);
    const size_t bytes = static_cast<size_t>(mine.size()) * elem;
    if (op.kind == OpKind::kReduceScatter) {
      for (int k = 1; k < L; ++k) {
        const int j = (l + k) % L;
        for (int mm = 0; mm < M; ++mm) {
          const Range part = op.sharded.ofRank(layout_.rankOf(mm, j), mine);
          sendBytes(op, slice, seg, layout_.rankOf(m, j), Phase::kReduceScatter, mm, op.inputAt(part), bytes, actions);
        }
      }
      continue;
    }
    for (int k = 1; k < M; ++k) {
      sendBytes(
          op, slice, seg, layout_.rankOf((m + k) % M, l), Phase::kCollect, 0, op.inputAt(mine), bytes, actions);
    }
    for (int k = 1; k < L; ++k) {
      sendBytes(op, slice, seg, layout_.rankOf(m, (l + k) % L), Phase::kReduceScatter, 0, nullptr, 0, actions);
    }
  }
}

namespace {
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
} // namespace

void AllreduceEngine::advanceReduceScatter(Op& op, Slice& slice, Segment& seg, Actions& actions) {
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  const int l = layout_.localRank();
  const int m = layout_.machine();
  const Range mine = op.sharded.segment(slice.index, seg.index);
  const auto inputPart = [&](int mm) {
    const Range part = op.sharded.ofRank(layout_.rankOf(mm, l), mine);
    return op.input.slice(0, part.begin, part.end);
  };
  const at::Tensor output = op.work.slice(0, mine.begin, mine.end);

  if (!seg.rsReduced) {
    if (seg.received[static_cast<int>(Phase::kReduceScatter)] < (L - 1) * M) {
      return;
    }
    // This machine's sum of each part of rail l, local ranks in order: my own
    // part's into the output, the other machines' into the first staged copy
    // (with one local rank those are sent straight from the input).
    std::vector<Reduction> reductions;
    for (int mm = 0; mm < M; ++mm) {
      std::vector<at::Tensor> staged;
      for (int j = 0; j < L - 1; ++j) {
        staged.push_back(stagedPiece(op, slice, seg, j * M + mm));
      }
      if (mm == m) {
        reductions.push_back(Reduction{output, inputPart(mm), staged});
      } else if (L > 1) {
        std::vector<at::Tensor> pieces{inputPart(mm)};
        pieces.insert(pieces.end(), staged.begin() + 1, staged.end());
        reductions.push_back(Reduction{staged.front(), at::Tensor(), pieces});
      }
    }
    reduceTask(
        op, slice, seg, [reductions, redop = op.op] { runReductions(reductions, redop); },
        [this](Slice&, Segment& done, Actions&) {
          done.rsReduced = true;
          stamp(timeline_, done.tRsReduced);
        });
    return;
  }

  if (M > 1 && !seg.collectSent) {
    seg.collectSent = true;
    const size_t bytes = static_cast<size_t>(mine.size()) * op.elemSize;
    for (int k = 1; k < M; ++k) {
      const int to = (m + k) % M;
      uint8_t* partial = L > 1 ? static_cast<uint8_t*>(stagedPiece(op, slice, seg, to).data_ptr())
                               : static_cast<uint8_t*>(inputPart(to).data_ptr());
      sendBytes(op, slice, seg, layout_.rankOf(to, l), Phase::kCollect, 0, partial, bytes, actions);
    }
  }

  if (!seg.shardReduced) {
    if (seg.received[static_cast<int>(Phase::kCollect)] < M - 1) {
      return;
    }
    stamp(timeline_, seg.tReduceStart);
    // The other machines' partial sums, in machine order; then AVG's division.
    std::vector<at::Tensor> partials;
    for (int i = 0; i < M - 1; ++i) {
      partials.push_back(stagedPiece(op, slice, seg, (L - 1) * M + i));
    }
    reduceTask(
        op, slice, seg,
        [output, partials, redop = op.op, world = layout_.worldSize()] {
          runReductions({Reduction{output, at::Tensor(), partials}}, redop);
          finishReduction(output, redop, world);
        },
        [this](Slice&, Segment& done, Actions&) {
          done.shardReduced = true;
          stamp(timeline_, done.tShardReduced);
        });
    return;
  }

  // The slot is released in finishSegment, once the partial sums sent from
  // it have left too.
  if (seg.sendsInFlight > 0 || seg.pendingReads > 0) {
    return;
  }
  finishSegment(op, slice, seg, actions);
}

void AllreduceEngine::advanceAllGather(Op& op, Slice& slice, Segment& seg, Actions& actions) {
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  const int l = layout_.localRank();
  const int m = layout_.machine();
  const Range mine = op.sharded.segment(slice.index, seg.index);

  if (!seg.rsReduced) {
    // My own part of the output (nothing to do when it is the input, in place).
    const Range own = op.sharded.ofRank(layout_.rank(), mine);
    reduceTask(
        op, slice, seg,
        [dst = op.work.slice(0, own.begin, own.end), src = op.input.slice(0, mine.begin, mine.end)] {
          runReductions({Reduction{dst, src, {}}}, c10d::ReduceOp::SUM);
        },
        [](Slice&, Segment& done, Actions&) { done.rsReduced = true; });
    return;
  }

  if (!seg.chunkFinal) {
    if (seg.received[static_cast<int>(Phase::kCollect)] < M - 1) {
      return;
    }
    seg.chunkFinal = true;
    stamp(timeline_, seg.tChunkFinal);
  }

  bool waiting = false;
  const size_t bytes = static_cast<size_t>(mine.size()) * op.elemSize;
  for (int k = 1; k < L; ++k) {
    const int j = (l + k) % L;
    if (seg.forwarded[j]) {
      continue;
    }
    if (!seg.announced[static_cast<int>(Phase::kReduceScatter)][j]) {
      waiting = true; // not ready: it may not have posted this operation yet
      continue;
    }
    seg.forwarded[j] = 1;
    for (int mm = 0; mm < M; ++mm) {
      uint8_t* part = mm == m ? op.inputAt(mine) : op.at(op.sharded.ofRank(layout_.rankOf(mm, l), mine));
      sendBytes(op, slice, seg, layout_.rankOf(m, j), Phase::kAllGather, mm, part, bytes, actions);
    }
  }
  if (waiting || seg.received[static_cast<int>(Phase::kAllGather)] < (L - 1) * M || seg.sendsInFlight > 0 ||
      seg.pendingReads > 0) {
    return;
  }
  finishSegment(op, slice, seg, actions);
}

} // namespace fairring
