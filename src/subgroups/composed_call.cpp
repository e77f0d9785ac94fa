// The data path of one CUDA allreduce, top to bottom: the units of its plan
// (call_cut.h) issued on their streams. Every step is a sub-group collective
// (or a kernel) issued from the calling thread, in the same order on every
// rank; each stream waits only for the step before on another stream, so the
// steps of consecutive pieces run at once. docs/design.md, "The pieces,
// overlapped", says why this order cannot deadlock and keeps every rank's
// result bit-identical.
#include "subgroups/subgroup_allreduce.h"

#include "faults/plants.h"
#include "ops/reduce_kind.h"
#include "subgroups/reduction.h"

namespace fairring {

void SubgroupAllreduce::await(const c10::intrusive_ptr<c10d::Work>& work, const c10d::Backend& group) {
  // synchronize() makes the current stream wait and never the host (wait()
  // blocks under TORCH_NCCL_BLOCKING_WAIT); it also empties ProcessGroupNCCL's
  // hold on the step's tensors, which is safe here: they are the caller's
  // (kept for the allocator on the step's stream, which now waits for the
  // collective) and the lane's staging (kept for the group's life). Gloo
  // (on CPU, and the test-only local groups of FAIRRING_TEST_LOCAL_GLOO on a
  // device) has written its result only once wait() returns: its CUDA
  // _reduce_scatter_base copies the output back inside wait().
  const bool gloo = group.getBackendName() == "gloo";
  if (streams_->onDevice() && !gloo && !plants::planted(plants::Plant::kStepWaitsOnHost)) {
    work->synchronize();
  } else {
    work->wait();
  }
  parts_.push_back(work);
}

void SubgroupAllreduce::premultiply(const at::Tensor& piece, RedOp op) const {
  if (premultiplies(op, piece.scalar_type()) && options_.worldSize > 1) {
    piece.div_(options_.worldSize); // divided, not times a rounded 1/N: exact where x/N is
  }
}

void SubgroupAllreduce::divideAfter(const at::Tensor& reduced, RedOp op) const {
  if (!premultiplies(op, reduced.scalar_type())) {
    finishReduction(reduced, op, options_.worldSize);
  }
}

void SubgroupAllreduce::reduceDirect(const at::Tensor& piece, RedOp op) {
  premultiply(piece, op);
  std::vector<at::Tensor> tensors{asReducible(piece)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = groupOp(op, piece.scalar_type());
  await(groups_.world->allreduce(tensors, opts), *groups_.world);
  divideAfter(piece, op);
}

int SubgroupAllreduce::issueDirect(const Held& held, const at::Tensor& work, RedOp op) {
  const int lane = ledger_.takeLane(held);
  auto onLane = streams_->enter(lane);
  streams_->keepAlive(work, lane);
  reduceDirect(work, op);
  return lane;
}

int SubgroupAllreduce::issueComposed(const Held& held, const at::Tensor& work, const CallCut& cut, RedOp op) {
  const bool local = options_.localSize > 1;
  std::vector<Unit> pieces;
  const Unit* tail = nullptr;
  std::vector<int> laneOf;
  for (const Unit& unit : cut.units) {
    if (unit.direct) {
      tail = &unit;
    } else {
      pieces.push_back(unit);
      laneOf.push_back(ledger_.takeLane(held));
    }
  }
  ledger_.countUnits(held, tail != nullptr ? 1 : 0, pieces.size());
  const int ag = streams_->allGatherStream();
  if (tail != nullptr && local) {
    // First, on the all-gather stream, whose own work starts only after the
    // first pieces' rail exchanges: the tail's latency hides under theirs.
    auto onGather = streams_->enter(ag);
    streams_->keepAlive(work, ag);
    reduceDirect(work.narrow(0, tail->begin, tail->size), op);
  }
  // The wavefront: at tick t the reduce-scatter of piece t, the rail exchange
  // of piece t-1 and the all-gather of piece t-2, each on its own stream.
  const int count = static_cast<int>(pieces.size());
  std::vector<Event> scattered(count);
  std::vector<Event> exchanged(count);
  for (int t = 0; t < count + 2; ++t) {
    if (local && t < count) {
      scattered[t] = reduceScatterStep(work, pieces[t], op);
    }
    if (t >= 1 && t - 1 < count) {
      exchanged[t - 1] = railStep(work, pieces[t - 1], laneOf[t - 1], scattered[t - 1], cut.exchange, op);
    }
    if (local && t >= 2) {
      allGatherStep(work, pieces[t - 2], exchanged[t - 2]);
    }
  }
  if (local) {
    // The all-gather stream ran every all-gather after its rail exchange,
    // each after its reduce-scatter, and the tail: it is done last.
    return ag;
  }
  int last = laneOf.back();
  if (tail != nullptr) {
    last = issueDirect(held, work.narrow(0, tail->begin, tail->size), op);
  }
  streams_->join(last);
  return last;
}

SubgroupAllreduce::Event SubgroupAllreduce::reduceScatterStep(const at::Tensor& work, const Unit& unit, RedOp op) {
  const int rs = streams_->reduceScatterStream();
  auto onStream = streams_->enter(rs);
  streams_->keepAlive(work, rs);
  at::Tensor piece = asReducible(work.narrow(0, unit.begin, unit.size));
  premultiply(piece, op);
  const int64_t chunk = unit.size / options_.localSize;
  at::Tensor mine = piece.narrow(0, options_.localRank * chunk, chunk);
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = groupOp(op, work.scalar_type());
  // In place: my chunk of the piece, reduced over this machine.
  await(groups_.localReduce->_reduce_scatter_base(mine, piece, opts), *groups_.localReduce);
  return streams_->mark(rs);
}

SubgroupAllreduce::Event SubgroupAllreduce::railStep(
    const at::Tensor& work,
    const Unit& unit,
    int lane,
    const Event& after,
    RailExchange how,
    RedOp op) {
  const int M = options_.numMachines;
  auto onLane = streams_->enter(lane);
  if (!plants::planted(plants::Plant::kRailSkipsReduceScatter)) {
    streams_->wait(lane, after);
  }
  streams_->keepAlive(work, lane);
  const at::ScalarType original = work.scalar_type();
  at::Tensor piece = asReducible(work.narrow(0, unit.begin, unit.size));
  if (options_.localSize == 1) {
    premultiply(piece, op); // with several local ranks, the reduce-scatter step did
  }
  const int64_t chunkElems = unit.size / options_.localSize;
  const int64_t shardElems = chunkElems / M;
  at::Tensor mine = piece.narrow(0, options_.localRank * chunkElems, chunkElems);
  const auto& rail = groups_.lanes.at(lane);
  std::vector<int64_t> even;
  if (how == RailExchange::kAllToAll) {
    // Every machine's copy of my shard here; their reduction, computed by me
    // alone (so every rank ends with the same bits), M times; and back: each
    // machine's reduced shard into its place in my chunk.
    const at::Tensor& slot = staging_.at(lane);
    const at::ScalarType dtype = piece.scalar_type();
    at::Tensor copies = region(slot, 0, chunkElems, dtype);
    at::Tensor reduced = region(slot, aligned256(options_.largestPieceBytes / options_.localSize), shardElems, dtype);
    await(rail->alltoall_base(copies, mine, even, even, c10d::AllToAllOptions()), *rail);
    reduceRows(copies.view({M, shardElems}), reduced, op, original);
    divideAfter(reduced, op);
    copies.view({M, shardElems}).copy_(reduced.expand({M, shardElems}));
    await(rail->alltoall_base(mine, copies, even, even, c10d::AllToAllOptions()), *rail);
  } else {
    // NCCL's own reduce-scatter and all-gather on the rail, in place: my shard
    // reduced over the machines lives only here, then every machine's comes.
    at::Tensor shard = mine.narrow(0, options_.machine * shardElems, shardElems);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = groupOp(op, original);
    await(rail->_reduce_scatter_base(shard, mine, opts), *rail);
    divideAfter(shard, op); // by the world, not the rail
    await(rail->_allgather_base(mine, shard, c10d::AllgatherOptions()), *rail);
  }
  return streams_->mark(lane);
}

void SubgroupAllreduce::allGatherStep(const at::Tensor& work, const Unit& unit, const Event& after) {
  const int ag = streams_->allGatherStream();
  auto onStream = streams_->enter(ag);
  streams_->wait(ag, after);
  streams_->keepAlive(work, ag);
  at::Tensor piece = asReducible(work.narrow(0, unit.begin, unit.size));
  const int64_t chunk = unit.size / options_.localSize;
  at::Tensor mine = piece.narrow(0, options_.localRank * chunk, chunk);
  // In place: every local rank's chunk into the piece.
  await(groups_.localGather->_allgather_base(piece, mine, c10d::AllgatherOptions()), *groups_.localGather);
}

} // namespace fairring
