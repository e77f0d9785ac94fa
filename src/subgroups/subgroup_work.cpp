#include "subgroups/subgroup_work.h"

#include <c10/core/impl/VirtualGuardImpl.h>

namespace fairring {

SubgroupWork::SubgroupWork(
    int rank,
    c10d::OpType opType,
    std::vector<at::Tensor> outputs,
    c10::intrusive_ptr<c10::ivalue::Future> future,
    std::shared_ptr<c10::Event> done,
    c10::Device device)
    : c10d::Work(rank, opType),
      outputs_(std::move(outputs)),
      future_(std::move(future)),
      done_(std::move(done)),
      device_(device) {}

bool SubgroupWork::isCompleted() {
  return !done_ || done_->query();
}

bool SubgroupWork::isSuccess() const {
  // Failures of the sub-groups' kernels are reported by their own watchdogs
  // (ProcessGroupNCCL's error handling); what reached this Work succeeded.
  return true;
}

bool SubgroupWork::wait(std::chrono::milliseconds /*timeout*/) {
  if (done_) {
    c10::impl::VirtualGuardImpl impl(device_.type());
    done_->block(impl.getStream(device_));
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
