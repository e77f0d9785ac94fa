#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "failure/group_failure.h"
#include "device/done_point.h"

namespace fairring {

// The Work of a sub-group allreduce, with ProcessGroupNCCL's semantics: the
// operation is complete for the host once it is enqueued. wait(),
// synchronize() and blockCurrentStream() make the caller's current stream
// wait for the done event; wait() blocks the host too, and only then, when
// given a timeout or under TORCH_NCCL_BLOCKING_WAIT (then the group's
// timeout), throwing if the device
// does not get there in time. isCompleted() asks whether the device has got
// there; exception() is the first failure of the sub-group collectives the
// operation is made of (their watchdogs find those), or the timeout of a
// wait. The future is already completed, CUDA-aware (its value's readers
// synchronise with the done point through their streams), so `.then()`
// callbacks run at once on the calling thread, which is what lets DDP comm
// hooks issue their nested collectives in the same order on every rank. On a
// CPU device (the test path over Gloo sub-groups) there is no event:
// everything finished before the call returned.
class SubgroupWork : public c10d::Work {
 public:
  SubgroupWork(
      int rank,
      c10d::OpType opType,
      std::vector<at::Tensor> outputs,
      c10::intrusive_ptr<c10::ivalue::Future> future,
      std::shared_ptr<EventDone> done,
      c10::Device device,
      std::vector<c10::intrusive_ptr<c10d::Work>> parts,
      std::string description,
      std::chrono::milliseconds groupTimeout,
      bool blockingWait,
      std::shared_ptr<GroupFailure> groupFailure,
      std::function<void()> abortOnTimeout);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void blockCurrentStream() override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  // The first failure of a part; `ask`: each part is asked to look first
  // (isCompleted(), which is how ProcessGroupNCCL finds an error where no
  // watchdog runs, under TORCH_NCCL_BLOCKING_WAIT).
  std::exception_ptr partFailure(bool ask = false) const;

  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<EventDone> done_;
  c10::Device device_;
  // The sub-group collectives of the operation (NCCL's works on a device):
  // their failures are this operation's.
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_;
  std::string description_; // "allreduce of N elements of T on rank R", for errors
  std::chrono::milliseconds groupTimeout_; // a blocking wait's limit when wait() names none
  const bool blockingWait_; // TORCH_NCCL_BLOCKING_WAIT, read once by the group (blocking_wait.h)
  // The group's: a wait that times out fails it from turn 0 (the device may
  // never get past this operation, so nothing after it may be issued).
  std::shared_ptr<GroupFailure> groupFailure_;
  // A wait that times out aborts the communicators the operation ran on, as
  // ProcessGroupNCCL's does with its own (WorkNCCL::wait: on a timeout,
  // "Abort NCCL communicators", WorkNCCL::abort -> ncclCommAbort of that
  // Work's communicator): their kernels may never end, and nothing after
  // them can run.
  const std::function<void()> abortOnTimeout_;
};

} // namespace fairring
