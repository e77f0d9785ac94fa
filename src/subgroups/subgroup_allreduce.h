#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "failure/group_failure.h"
#include "subgroups/call_ledger.h"
#include "subgroups/call_cut.h"
#include "device/done_point.h"
#include "subgroups/drain.h"
#include "subgroups/in_flight_ops.h"
#include "subgroups/lane_streams.h"
#include "subgroups/subgroup_set.h"

namespace fairring {

struct SubgroupOptions {
  int rank{0};
  int worldSize{1};
  int localSize{1};
  int numMachines{1};
  int localRank{0};
  int machine{0};
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // The plan (fairring_pg.model.cuda_plan, made once per group, the same on
  // every rank): what a call of each size runs.
  std::vector<PlanRow> plan;
  size_t largestPieceBytes{0}; // a multiple of 16*L*M: no piece is larger
  size_t laneStagingBytes{0}; // each lane's staging for pieces of that size (fairring_pg.config)
  size_t totalMemory{0};
};

// What the path has done, for tests and benchmarks to read, and how destroy
// or abort ended.
struct SubgroupStats : CallCounts {
  uint64_t eventsCreated{0}; // by the event pool, ever
  SubgroupsClosed closed;
};

// The reduction-server allreduce as a composition of sub-group collectives,
// issued from the calling thread in call order (so in the same order on every
// rank). A call is cut into pieces (call_cut.h); each piece goes through
//   1. reduce-scatter on the local group, in place: my chunk, reduced over the machine;
//   2. the rail exchange on a lane's rail group: my shard reduced over the
//      machines, and every machine's reduced shard back into my chunk;
//   3. all-gather of the chunks on the local group, in place;
// each step on a stream of its own, waiting for the step before it, so that
// the steps of consecutive pieces run at once (composed_call.cpp). Which calls
// come here is ComposedPath's choice (composed_path.h): the others are the
// delegate's own, ordered after and before these by orderBefore/orderAfter.
// See docs/design.md for why this cannot deadlock and what the streams do.
class SubgroupAllreduce {
 public:
  using RedOp = c10d::ReduceOp::RedOpType;

  SubgroupAllreduce(Subgroups groups, SubgroupOptions options, c10::DeviceType deviceType);

  SubgroupAllreduce(const SubgroupAllreduce&) = delete;
  SubgroupAllreduce& operator=(const SubgroupAllreduce&) = delete;

  // How a call of `numel` elements of `dtype` (the caller's) is cut, from the
  // plan and the job's shape only: the same on every rank for the same call.
  CallCut cutFor(int64_t numel, at::ScalarType dtype) const;

  // The composition of a call cutFor() cuts into pieces, of a dtype and op
  // it reduces (checkReducible), not under capture: ComposedPath decided so.
  c10::intrusive_ptr<c10d::Work> allreduce(at::Tensor& tensor, RedOp op);
  c10::intrusive_ptr<c10d::Work> allreduceCoalesced(std::vector<at::Tensor>& tensors, RedOp op);
  // The plant kDirectThroughOurStreams only: a call that does not compose,
  // as one allreduce on the world group issued on the group's streams.
  c10::intrusive_ptr<c10d::Work> allreduceOnOurStreams(at::Tensor& tensor, RedOp op);
  // An allreduce goes to the delegate's own (the plan's row `row`): counted,
  // or refused with the group's failure, as every allreduce after it is.
  void countDelegated(size_t row);

  // A collective of the delegate is about to run on `tensors`: the caller's
  // current stream waits for the allreduces in flight whose bytes they share,
  // as it would behind them on NCCL's one stream. Under CUDA graph capture it
  // neither asks about nor waits for them (either would break the capture):
  // the captured collective runs when the graph is replayed, which NCCL
  // orders after nothing either.
  void orderBefore(const std::vector<at::Tensor>& tensors);
  // ... and once it is issued (`work`, the delegate's), allreduces issued
  // later on the same bytes wait for it, through its future (WorkDone), never
  // its wait() or synchronize(), which would empty ProcessGroupNCCL's hold on
  // the caller's memory. Nothing is recorded on the device. Not under capture.
  void orderAfter(const std::vector<at::Tensor>& tensors, const c10::intrusive_ptr<c10d::Work>& work);

  // barrier(): the host waits until the device has finished every allreduce
  // issued on this group (as NCCL's barrier waits for the group's earlier
  // collectives), up to the group's timeout, holding no lock; raises the
  // group's failure, or one a sub-group reports meanwhile, or the timeout
  // (which then fail the group: GroupFailure).
  void awaitIssued();

  // destroy_process_group(): waits on the host, up to the group's timeout,
  // until the device has finished every allreduce issued (a peer may still
  // need this rank's sends), then shuts the sub-groups down gracefully. After
  // a failure (the group's, or one a sub-group reports while waiting) it waits
  // no longer, and if the time passes it stops waiting too: then every
  // sub-group, the world group included, is aborted, since a graceful NCCL
  // shutdown would wait for the collectives that will never end. No lock is
  // held while waiting. Never throws. Idempotent.
  void shutdown();
  // Aborts every sub-group but the world group (the backend owns that one)
  // at once, with whatever is in flight; a shutdown waiting meanwhile stops.
  void abort();

  SubgroupStats stats() const;

 private:
  // The group's life, one value; what failed is GroupFailure's.
  enum class Life : uint8_t {
    kUnconnected, // no composed call yet: no streams, the sub-groups not connected
    kConnecting, // the first composed call connects them, holding no lock
    kReady, // composed calls run
    kStopped, // destroy or abort began: no more calls; the sub-groups still open
    kClosed, // the sub-groups shut down or aborted (by one closer, once)
  };

  // What an operation reduces, made on the stream of its first step once that
  // stream waits for everything the caller's tensors wait for.
  struct Prepared {
    at::Tensor work; // flat, in the dtype the sub-groups reduce
    std::function<void()> finish; // writes the result back (null: `work` is the caller's tensor)
    std::vector<at::Tensor> buffers; // made for the operation and read by `finish`
  };

  using Event = LaneStreams::Event;

  c10::intrusive_ptr<c10d::Work> run(
      std::vector<at::Tensor> outputs,
      const CallCut& cut,
      at::ScalarType dtype,
      RedOp op,
      c10d::OpType type,
      const std::function<Prepared()>& prepare);
  // Issues the call's units on their streams; returns the stream it is done on.
  int issue(
      const Held& held,
      const CallCut& cut,
      RedOp op,
      const std::function<Prepared()>& prepare,
      Prepared& prepared,
      uint64_t turn);
  // The stream an operation's first step runs on (where prepare() copies).
  int firstStream(const Held& held, const CallCut& cut) const;
  // The call's units issued on their streams (composed_call.cpp); returns
  // the stream the operation is done on.
  int issueDirect(const Held& held, const at::Tensor& work, RedOp op);
  int issueComposed(const Held& held, const at::Tensor& work, const CallCut& cut, RedOp op);
  Event reduceScatterStep(const at::Tensor& work, const Unit& piece, RedOp op);
  Event railStep(const at::Tensor& work, const Unit& piece, int lane, const Event& after, RailExchange how, RedOp op);
  void allGatherStep(const at::Tensor& work, const Unit& piece, const Event& after);
  void reduceDirect(const at::Tensor& piece, RedOp op);
  // AVG's 1/N: on this rank's input of a piece before any sum (16-bit floats,
  // reduction.h's premultiplies), or on the reduced shard after it (others).
  void premultiply(const at::Tensor& piece, RedOp op) const;
  void divideAfter(const at::Tensor& reduced, RedOp op) const;
  // Orders the current (step's) stream after `work`'s collective, on the
  // device only (a step never makes the host wait: TORCH_NCCL_BLOCKING_WAIT
  // would otherwise run the steps one at a time), and keeps it as a part of
  // the operation in progress. On CPU (Gloo) the wait blocks: that is all
  // Gloo has.
  void await(const c10::intrusive_ptr<c10d::Work>& work, const c10d::Backend& group);
  // Makes the streams and connects every sub-group at the first composed call,
  // without holding mu_ while it waits for the peers; fails the group (turn 0)
  // if that fails.
  void useDevice(c10::Device device, std::unique_lock<std::mutex>& lock);
  void connect(LaneStreams& streams);
  bool composes() const {
    return std::any_of(options_.plan.begin(), options_.plan.end(), [](const PlanRow& row) {
      return row.path == PlanPath::kCompose;
    });
  }
  bool stopped() const {
    return life_.load() >= Life::kStopped;
  }
  // Whether the sub-groups were shut down or aborted: every wait on the host
  // (connecting, draining) stops then.
  bool closed() const {
    return life_.load() == Life::kClosed;
  }
  // Waits on the host for `pending` (no lock held): a sub-group's error and an
  // abort end it early.
  DrainEnd drain(const std::vector<Done>& pending);
  // Why a drain that did not end kDrained ended: `subgroupError` if a
  // sub-group's error (or an abort) stopped it, else the timeout.
  std::string whyNotDrained(DrainEnd end, const std::string& subgroupError) const;
  // Moves to kClosed and closes the sub-groups (`graceful`: shut down, else
  // aborted), once, outside the lock.
  void close(bool graceful, bool withWorld, const std::string& outcome);
  void checkTensor(const at::Tensor& t, const std::string& name) const;
  // The device of the first of `tensors` on this path's kind of device.
  c10::Device deviceOf(const std::vector<at::Tensor>& tensors) const;
  [[noreturn]] void failAt(uint64_t turn, const std::string& message);
  // The in-flight operations whose bytes overlap `ranges` (on the device
  // only); the tensors of those among them that are eventless delegated calls
  // go to `kept`, their Works waited for on the caller's current stream.
  std::vector<Done> earlierOverlapping(
      const Held& held,
      const std::vector<ByteRange>& ranges,
      std::vector<at::Tensor>& kept);

  SubgroupSet set_;
  const Subgroups& groups_; // set_'s
  const SubgroupOptions options_;
  const c10::DeviceType deviceType_;
  const int numLanes_;
  // Shared with the Works, which fail the group when a wait of theirs times out.
  const std::shared_ptr<GroupFailure> failure_{std::make_shared<GroupFailure>()};
  std::atomic<Life> life_{Life::kUnconnected};

  // One operation's units are issued together, and operations in call order.
  mutable std::mutex mu_;
  std::condition_variable connected_; // life_ left kConnecting
  std::unique_ptr<LaneStreams> streams_; // made and connected at the first composed call
  std::vector<at::Tensor> staging_; // one slot per lane, bytes (the all-to-all exchange's)
  CallLedger ledger_;
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_; // of the operation being issued
  bool blockingWait_{false}; // TORCH_NCCL_BLOCKING_WAIT (blocking_wait.h), read once
};

} // namespace fairring
