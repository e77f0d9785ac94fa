#include "subgroups/subgroup_work.h"

#include <c10/util/Exception.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "subgroups/lane_streams.h"

namespace fairring {

SubgroupWork::SubgroupWork(
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
    std::function<void()> abortOnTimeout)
    : c10d::Work(rank, opType),
      outputs_(std::move(outputs)),
      future_(std::move(future)),
      done_(std::move(done)),
      device_(device),
      parts_(std::move(parts)),
      description_(std::move(description)),
      groupTimeout_(groupTimeout),
      blockingWait_(blockingWait),
      groupFailure_(std::move(groupFailure)),
      abortOnTimeout_(std::move(abortOnTimeout)) {}

std::exception_ptr SubgroupWork::partFailure(bool ask) const {
  for (const auto& part : parts_) {
    if (ask) {
      part->isCompleted();
    }
    if (auto failure = part->exception()) {
      return failure;
    }
  }
  return nullptr;
}

std::exception_ptr SubgroupWork::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exception_ ? exception_ : partFailure();
}

bool SubgroupWork::isSuccess() const {
  return exception() == nullptr;
}

bool SubgroupWork::isCompleted() {
  return exception() != nullptr || !done_ || done_->reached();
}

void SubgroupWork::synchronize() {
  if (done_) {
    fairring::blockCurrentStream(*done_, device_);
  }
  // Under allow_inflight_collective_as_graph_input the process group put this
  // Work in torch's registry (ProcessGroup.hpp); a wait takes it out, as
  // ProcessGroupNCCL's WorkNCCL::synchronize does.
  if (c10d::allow_inflight_collective_as_graph_input()) {
    c10d::unregister_work(c10::intrusive_ptr<c10d::Work>::unsafe_reclaim_from_nonowning(this));
  }
}

void SubgroupWork::blockCurrentStream() {
  synchronize();
}

bool SubgroupWork::wait(std::chrono::milliseconds timeout) {
  if (auto failure = exception()) {
    std::rethrow_exception(failure);
  }
  synchronize();
  if (done_ && (timeout != kNoTimeout || blockingWait_)) {
    const auto limit = timeout != kNoTimeout ? timeout : groupTimeout_;
    const Status reached = waitOnHost(
        *done_, std::chrono::steady_clock::now() + limit, [this] { return partFailure(/*ask=*/true) != nullptr; });
    if (auto failure = exception()) {
      std::rethrow_exception(failure);
    }
    if (!reached.ok()) {
      const std::string message = "fairring: " + description_ + " did not finish within " +
          std::to_string(limit.count()) + " ms (the timeout of its wait)";
      groupFailure_->fail(message, 0);
      if (abortOnTimeout_) {
        abortOnTimeout_();
      }
      auto error = std::make_exception_ptr(c10::DistBackendError(message));
      {
        std::lock_guard<std::mutex> lock(mutex_);
        exception_ = error;
      }
      std::rethrow_exception(error);
    }
  }
  return true;
}

std::vector<at::Tensor> SubgroupWork::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> SubgroupWork::getFuture() {
  return future_;
}

} // namespace fairring
