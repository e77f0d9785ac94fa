#pragma once

#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "vehicle_ledger.h"

// A stand-in for today's ProcessGroupNCCL (torch >= 2.8) on the stream vehicle
// (vehicle_device.h), over a Gloo group. What it copies is how ProcessGroupNCCL
// keeps memory safe, because that is what fairring must not break:
//  - an asynchronous collective (opts.asyncOp, what every Work-returning call
//    asks for) runs on a communication stream of the group's own, which first
//    waits for the caller's current stream; it calls no record_stream: its
//    tensors (and any temporary it makes, such as the flattened input of the
//    list form of reduce_scatter) sit on the Work's shelf until wait() or
//    synchronize() makes the caller's current stream wait for its end and
//    empties the shelf, or until the watchdog has seen it end and the group's
//    next collective empties it (the late release, the only safety net);
//  - a blocking one (asyncOp false) runs on the caller's current stream and
//    returns no Work (ProcessGroupNCCL::collective: "return asyncOp ? work :
//    nullptr"; torch 2.13's distributed_c10d.py l.3247-3253: "the backend has
//    sync'ed at CPP level");
//  - its future is marked on the communication stream; isCompleted() asks
//    the end event; TORCH_NCCL_BLOCKING_WAIT makes wait() (not
//    synchronize()) also block the host until the end;
//  - as NCCL does, it runs the group's kernels one after the other whatever
//    stream each was issued on; its barrier waits for them on the host; it
//    refuses a non-contiguous tensor with ProcessGroupNCCL's words;
//  - send and recv (ProcessGroupNCCL::pointToPoint) run on a stream and
//    communicator of the pair's own ("low:high", without a bound device),
//    apart from the group's collectives, tell the allocator of that stream
//    (recordStream) instead of a shelf, and return a Work even when
//    synchronous; inside a block they return none;
//  - a coalescing block (startCoalescing .. endCoalescing, what
//    batch_isend_irecv uses) runs its calls as one launch at the end on the
//    group's stream; the calls inside return no Work, and the end's Work has
//    a future marked with an empty list, which carries no event
//    (ProcessGroupNCCL::endCoalescing: "markCompleted(at::IValue(
//    std::vector<at::Tensor>{}))"; c10's Future::markCompleted records events
//    only on the devices of its value's storages, ivalue_inl.h l.928-971 in
//    torch 2.13), as have the lists of all_gather and reduce_scatter of uneven
//    sizes (ProcessGroupNCCL::allgather and reduce_scatter when
//    check_same_size fails: broadcasts and reduces in such a block); an empty
//    block's end returns no Work;
//  - AVG divides 16-bit floats by N before the sum (NCCL 2.28's ncclAvg:
//    src/enqueue.cc l.2285-2320, hostToDevRedOp, ncclDevPreMulSum for floats)
//    and divides other floats' sum (the order of sums differs anyway);
//  - TORCH_NCCL_BLOCKING_WAIT (then NCCL_BLOCKING_WAIT) is read as torch's
//    getCvarBool reads it (torch 2.13's Utils.hpp l.151-189 over
//    ProcessGroupNCCL.hpp l.60-62): y, yes, t, true, 1 in any case;
//  - synchronize() takes its Work out of torch's registry under
//    allow_inflight_collective_as_graph_input, as WorkNCCL::synchronize does
//    (ProcessGroup.hpp l.28-51 in torch 2.13);
//  - all_to_all's list form is an ordinary collective (ProcessGroupNCCL::
//    alltoall: collective(), a future marked with its outputs).
// The bytes move through Gloo, at once, on host views of the vehicle tensors.
namespace vehicle {

// Tensors held for the caching allocator's sake until a collective is known to
// have ended on the device (ProcessGroupNCCL's TensorShelf).
class Shelf {
 public:
  void stash(const std::vector<at::Tensor>& tensors);
  // Drops the references (outside the lock: a drop may free a block).
  void unstash();

 private:
  std::mutex mu_;
  std::vector<at::Tensor> tensors_;
};

class StreamedBackend : public c10d::Backend {
 public:
  StreamedBackend(c10::intrusive_ptr<c10d::Backend> gloo, std::string name);

  const std::string getBackendName() const override {
    return "vehicle";
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  bool supportsCoalescing() const override {
    return true;
  }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10d::ErrorType getError() override {
    return c10d::ErrorType::SUCCESS;
  }
  void shutdown() override;
  void abort() override;

  // How many collectives this group has run (tests check what went where).
  int64_t collectives() const {
    return collectives_;
  }
  // Shelves still held (their collective not known to have ended).
  size_t heldShelves();

 private:
  // Runs `onHost` (the Gloo collective on host views) as one launch, on the
  // communication stream (async) or the caller's current stream, and holds
  // the inputs, outputs and `temporaries` (written by the launch, not part of
  // the result) as ProcessGroupNCCL does.
  // `eventless`: the Work's future is marked with an empty list (a coalesced
  // Work's). Inside a coalescing block it runs at once and returns no Work.
  c10::intrusive_ptr<c10d::Work> run(
      const std::string& op,
      bool async,
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs,
      const std::vector<at::Tensor>& temporaries,
      const std::function<void()>& onHost,
      bool eventless = false);
  // A point-to-point call with `peer`: `start` issues it on Gloo (not waited).
  c10::intrusive_ptr<c10d::Work> pointToPoint(
      const std::string& op,
      int peer,
      const std::vector<at::Tensor>& tensors,
      bool writes,
      const std::function<c10::intrusive_ptr<c10d::Work>()>& start);
  // One launch of `op` on `stream`, after the group's previous one.
  void launch(
      const c10::Stream& stream,
      const std::string& op,
      const std::vector<at::Tensor>& reads,
      const std::vector<at::Tensor>& writes,
      const std::function<void()>& onHost);
  // The watchdog and the next call's clean-up in one: the shelves of
  // collectives the host knows to have ended are emptied.
  void releaseEnded();

  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::string name_;
  int64_t stream_; // the communication stream's id
  bool blockingWait_;
  int64_t collectives_{0};
  std::mutex mu_;
  struct Watched {
    Clock end;
    std::shared_ptr<Shelf> shelf;
  };
  std::vector<Watched> watched_; // the watchdog's list
  std::mutex launchMu_; // one launch at a time, in order
  c10::Event previous_{c10::DeviceType::PrivateUse1}; // where the group's last launch ends
  // The communicator and stream of each pair's point-to-point calls, by peer.
  struct Pair {
    int64_t stream;
    std::shared_ptr<c10::Event> previous;
  };
  std::map<int, Pair> pairs_;
  // An open coalescing block's sends and receives: what each reads and
  // writes, and how it is issued (on Gloo, waited for at the block's end).
  struct Deferred {
    std::string op;
    std::vector<at::Tensor> reads;
    std::vector<at::Tensor> writes;
    std::function<c10::intrusive_ptr<c10d::Work>()> start;
  };
  bool coalescing_{false};
  std::vector<Deferred> deferred_;
};

// Whether `work` is a Work this stand-in made (the delegate's own, returned as is).
bool isStreamedWork(const c10::intrusive_ptr<c10d::Work>& work);

} // namespace vehicle
