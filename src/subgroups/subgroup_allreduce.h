#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "subgroups/in_flight_ops.h"
#include "subgroups/lane_streams.h"

namespace fairring {

// The process groups the allreduce is composed of, made in Python from the
// store (fairring_pg/subgroups.py): ProcessGroupNCCL for CUDA tensors, and
// ProcessGroupGloo for the CPU test path that runs this same code in CI.
struct Subgroups {
  // Every rank of the job: one machine, small tensors and slice tails.
  c10::intrusive_ptr<c10d::Backend> world;
  // This machine's ranks (several local ranks only). Two groups, so that a
  // reduce-scatter and an all-gather of different slices can be in flight
  // at once: one communicator runs its operations one after the other.
  c10::intrusive_ptr<c10d::Backend> localReduce;
  c10::intrusive_ptr<c10d::Backend> localGather;
  // This rank's rail (same local rank on every machine), one per lane
  // (several machines only): K communicators put K slices on the wire at once.
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
  size_t sliceBytes{0}; // a multiple of 8*L*M that lets every lane hold a slot
  size_t directBelowBytes{0};
  size_t totalMemory{0};
};

// The reduction-server allreduce as a composition of sub-group collectives.
// Per slice, issued from the calling thread in call order (so in the same
// order on every rank) on the stream of its lane:
//   1. reduce-scatter on the local group: my chunk, reduced over the machine;
//   2. collect: all-to-all of my chunk's M shards on the lane's rail group;
//   3. reduce the M copies of my shard (AVG divides here, once);
//   4. diffuse: all-gather of the reduced shards on the lane's rail group;
//   5. all-gather of the chunks on the local group, into the caller's tensor.
// See docs/design.md for why this cannot deadlock and what the streams do.
class SubgroupAllreduce {
 public:
  using RedOp = c10d::ReduceOp::RedOpType;

  SubgroupAllreduce(Subgroups groups, SubgroupOptions options, c10::DeviceType deviceType);

  c10::intrusive_ptr<c10d::Work> allreduce(at::Tensor& tensor, RedOp op);
  c10::intrusive_ptr<c10d::Work> allreduceCoalesced(std::vector<at::Tensor>& tensors, RedOp op);

  // A collective of another group (the delegate) is about to run on
  // `tensors`: the caller's current stream waits for the allreduces in
  // flight that touch them, as it would behind them on NCCL's one stream.
  void orderBefore(const std::vector<at::Tensor>& tensors);

  // destroy_process_group(): waits on the host, up to the group's timeout,
  // until the device has finished every allreduce issued (a peer may still
  // need this rank's sends), then shuts the sub-groups down; if that time
  // passes, aborts them instead. Never throws. Idempotent.
  void shutdown();
  // Aborts every sub-group but the world group (the backend owns that one)
  // at once, with whatever is in flight.
  void abort();

 private:
  c10::intrusive_ptr<c10d::Work> run(
      at::Tensor work,
      RedOp op,
      c10d::OpType type,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish,
      std::vector<at::Tensor> buffers);
  void reduceSlice(const at::Tensor& slice, int lane, RedOp op);
  void reduceDirect(const at::Tensor& piece, RedOp op);
  // Issues `work`'s collective's wait on the current (lane) stream and keeps
  // it as a part of the operation in progress.
  void await(const c10::intrusive_ptr<c10d::Work>& work);
  void useDevice(c10::Device device);
  void connect();
  std::vector<c10::intrusive_ptr<c10d::Backend>> ownedGroups() const;
  void refuseCapture(c10::Device device) const;
  void checkTensor(const at::Tensor& t, const std::string& name) const;

  const Subgroups groups_;
  const SubgroupOptions options_;
  const c10::DeviceType deviceType_;
  const int numLanes_;

  // One operation's units are issued together, and operations in call order.
  std::mutex mu_;
  std::string failure_;
  std::unique_ptr<LaneStreams> streams_; // made at the first operation (its device)
  std::vector<at::Tensor> staging_; // one slot per lane, bytes
  uint64_t nextUnit_{0};
  InFlightOps inFlight_;
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_; // of the operation being issued
  bool stopped_{false};
};

} // namespace fairring
