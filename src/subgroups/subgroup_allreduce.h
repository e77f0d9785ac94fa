#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "subgroups/call_plan.h"
#include "subgroups/drain.h"
#include "subgroups/in_flight_ops.h"
#include "subgroups/lane_streams.h"

namespace fairring {

// The process groups the allreduce is composed of, made in Python from the
// store (fairring_pg/subgroups.py): ProcessGroupNCCL for CUDA tensors, and
// ProcessGroupGloo for the CPU test path that runs this same code in CI.
struct Subgroups {
  // Every rank of the job: NCCL's own allreduce, and the tails of pieces.
  c10::intrusive_ptr<c10d::Backend> world;
  // This machine's ranks (several local ranks only). Two groups, so that the
  // reduce-scatter of one piece and the all-gather of another run at once:
  // one communicator runs its operations one after the other.
  c10::intrusive_ptr<c10d::Backend> localReduce;
  c10::intrusive_ptr<c10d::Backend> localGather;
  // This rank's rail (same local rank on every machine), one per lane:
  // K communicators put K pieces on the wire at once. Empty where the plan
  // composes no call (one machine, one rank per machine under auto, unknown
  // node facts, FAIRRING_CUDA_ALLREDUCE=direct, or no size where composing
  // wins), and then neither are the local groups made.
  std::vector<c10::intrusive_ptr<c10d::Backend>> lanes;
};

struct SubgroupOptions {
  int rank{0};
  int worldSize{1};
  int localSize{1};
  int numMachines{1};
  int localRank{0};
  int machine{0};
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // The plan (fairring_pg.model.cuda_plan, made once per group, the same on
  // every rank): what a call of each size runs. Empty: NCCL's allreduce.
  std::vector<PlanRow> plan;
  size_t largestPieceBytes{0}; // a multiple of 8*L*M: no piece is larger
  size_t laneStagingBytes{0}; // each lane's staging for pieces of that size (fairring_pg.config)
  size_t totalMemory{0};
};

// What the path has done, for tests and benchmarks to read (which path each
// allreduce took, whether ordering made it wait) and for a destroy to say how
// it ended.
struct SubgroupStats {
  uint64_t operations{0}; // allreduces and coalesced allreduces issued
  uint64_t ncclCalls{0}; // operations that were one NCCL allreduce on the world group
  uint64_t composedCalls{0}; // operations cut into pieces
  uint64_t directUnits{0}; // pieces reduced by one allreduce on the world group (a call, or a tail)
  uint64_t slicedUnits{0}; // pieces that went through the composition
  std::vector<uint64_t> rows; // operations per row of the plan
  // Earlier operations, still in flight on bytes a later one touches, that it
  // was made to wait for (an allreduce's streams, or the caller's stream
  // before a collective handed to the delegate).
  uint64_t orderingWaits{0};
  // Collectives handed to the delegate under CUDA graph capture on bytes of
  // an allreduce that may still be in flight: not ordered after it (events
  // from outside a capture cannot be waited for inside it).
  uint64_t unorderedInCapture{0};
  std::string shutdown{"running"}; // how destroy or abort ended
  int abortedGroups{0};
};

// The reduction-server allreduce as a composition of sub-group collectives,
// issued from the calling thread in call order (so in the same order on every
// rank). A call is cut into pieces (call_plan.h); each piece goes through
//   1. reduce-scatter on the local group, in place: my chunk, reduced over the machine;
//   2. the rail exchange on a lane's rail group: my shard reduced over the
//      machines, and every machine's reduced shard back into my chunk;
//   3. all-gather of the chunks on the local group, in place;
// each step on a stream of its own, waiting for the step before it, so that
// the steps of consecutive pieces run at once (composed_call.cpp).
// See docs/design.md for why this cannot deadlock and what the streams do.
class SubgroupAllreduce {
 public:
  using RedOp = c10d::ReduceOp::RedOpType;

  SubgroupAllreduce(Subgroups groups, SubgroupOptions options, c10::DeviceType deviceType);

  SubgroupAllreduce(const SubgroupAllreduce&) = delete;
  SubgroupAllreduce& operator=(const SubgroupAllreduce&) = delete;

  c10::intrusive_ptr<c10d::Work> allreduce(at::Tensor& tensor, RedOp op);
  c10::intrusive_ptr<c10d::Work> allreduceCoalesced(std::vector<at::Tensor>& tensors, RedOp op);

  // A collective of another group (the delegate) is about to run on
  // `tensors`: the caller's current stream waits for the allreduces in
  // flight whose bytes they share, as it would behind them on NCCL's one
  // stream. Under CUDA graph capture it neither asks about nor waits for
  // them (either would break the capture): the captured collective runs
  // when the graph is replayed, which NCCL orders after nothing either.
  void orderBefore(const std::vector<at::Tensor>& tensors);
  // ... and once it is issued (`work`, the delegate's), the allreduces issued
  // later on the same bytes wait for it, as they would behind it on NCCL's one
  // stream: a stream of the group's own waits for the collective (the work's
  // synchronize(), which does not block the host) and marks where it ends.
  // Not under capture, for the reasons above.
  void orderAfter(const std::vector<at::Tensor>& tensors, c10d::Work& work);

  // barrier(): the host waits until the device has finished every allreduce
  // issued on this group (as NCCL's barrier waits for the group's earlier
  // collectives), up to the group's timeout, holding no lock; raises the
  // group's failure, or one a sub-group reports meanwhile, or the timeout.
  void awaitIssued();

  // destroy_process_group(): waits on the host, up to the group's timeout,
  // until the device has finished every allreduce issued (a peer may still
  // need this rank's sends), then shuts the sub-groups down gracefully. After
  // a failure (this group's first error, or one a sub-group reports while
  // waiting) it waits no longer, and if the time passes it stops waiting too:
  // then every sub-group, the world group included, is aborted, since a
  // graceful NCCL shutdown would wait for the collectives that will never
  // end. No lock is held while waiting. Never throws. Idempotent.
  void shutdown();
  // Aborts every sub-group but the world group (the backend owns that one)
  // at once, with whatever is in flight; a shutdown waiting meanwhile stops.
  void abort();

  SubgroupStats stats() const;

 private:
  using DoneEvent = LaneStreams::Event;

  // What an operation reduces, made on the lane of its first unit once that
  // lane waits for everything the caller's tensors wait for.
  struct Prepared {
    at::Tensor work; // flat, in the dtype the sub-groups reduce
    std::function<void()> finish; // writes the result back (null: `work` is the caller's tensor)
    std::vector<at::Tensor> buffers; // made for the operation and read by `finish`
  };

  using Event = LaneStreams::Event;

  c10::intrusive_ptr<c10d::Work> run(
      std::vector<at::Tensor> outputs,
      int64_t numel,
      at::ScalarType dtype,
      RedOp op,
      c10d::OpType type,
      const std::function<Prepared()>& prepare);
  // The stream an operation's first step runs on (where prepare() copies).
  int firstStream(const CallPlan& plan) const;
  void countCall(const CallPlan& plan, size_t orderingWaits);
  // The call's units issued on their streams (composed_call.cpp); returns
  // the stream the operation is done on.
  int issueDirect(const at::Tensor& work, RedOp op);
  int issueComposed(const at::Tensor& work, const CallPlan& plan, RedOp op);
  Event reduceScatterStep(const at::Tensor& work, const Unit& piece, RedOp op);
  Event railStep(const at::Tensor& work, const Unit& piece, int lane, const Event& after, RailExchange how, RedOp op);
  void allGatherStep(const at::Tensor& work, const Unit& piece, const Event& after);
  void reduceDirect(const at::Tensor& piece, RedOp op);
  // Issues `work`'s collective's wait on the current (lane) stream and keeps
  // it as a part of the operation in progress.
  void await(const c10::intrusive_ptr<c10d::Work>& work);
  // Makes the streams and connects every sub-group at the first operation,
  // without holding mu_ while it waits for the peers; sets failure_ if that
  // fails.
  void useDevice(c10::Device device);
  void connect(LaneStreams& streams);
  bool composes() const {
    return !groups_.lanes.empty();
  }
  // `withWorld`: the world group too (the backend's delegate, which the
  // backend shuts down itself after a graceful end).
  std::vector<c10::intrusive_ptr<c10d::Backend>> subgroups(bool withWorld) const;
  bool anySubgroupFailed() const;
  // Shuts the sub-groups down (`graceful`) or aborts them, once, outside the lock.
  void close(bool graceful, bool withWorld, const std::string& outcome);
  void refuseCapture(c10::Device device) const;
  void checkTensor(const at::Tensor& t, const std::string& name) const;

  const Subgroups groups_;
  const SubgroupOptions options_;
  const c10::DeviceType deviceType_;
  const int numLanes_;

  // One operation's units are issued together, and operations in call order.
  mutable std::mutex mu_;
  std::condition_variable connected_; // connecting_ went false
  bool connecting_{false};
  std::string failure_;
  std::unique_ptr<LaneStreams> streams_; // made and connected at the first operation (its device)
  std::vector<at::Tensor> staging_; // one slot per lane, bytes (the all-to-all exchange's)
  uint64_t nextUnit_{0};
  InFlightOps<DoneEvent> inFlight_;
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_; // of the operation being issued
  SubgroupStats stats_;
  std::atomic<bool> stopped_{false}; // no more operations
  std::atomic<bool> aborting_{false}; // read by the waits of connecting and draining, which hold no lock
  // How the sub-groups were closed; apart from mu_, which an allreduce holds
  // while it issues, so that abort() never waits for one.
  mutable std::mutex closeMu_;
  bool closed_{false};
  std::string shutdown_{"running"};
  int abortedGroups_{0};
};

} // namespace fairring
