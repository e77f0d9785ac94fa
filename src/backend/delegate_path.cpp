#include "backend/delegate_path.h"

#include <c10/util/Exception.h>

#include "faults/plants.h"

namespace fairring {

c10::intrusive_ptr<c10d::Work> DelegatePath::delegated(
    const std::vector<at::Tensor>& tensors,
    const Issue& issue,
    Callers callers,
    const std::optional<Announced>& /*what*/) {
  TORCH_CHECK(delegate_, "fairring: rank ", rank_, ": ", unavailable_);
  barrier_.used(callers);
  return issue(*delegate_);
}

void DelegatePath::awaitIssued(const c10d::BarrierOptions& opts) {
  barrier_.await(delegate_, opts);
}

void DelegateBarrier::used(DevicePath::Callers callers) {
  if (callers == DevicePath::Callers::kEveryRank || plants::planted(plants::Plant::kPointToPointMarksDelegate)) {
    used_.store(true, std::memory_order_relaxed);
  }
}

void DelegateBarrier::await(const c10::intrusive_ptr<c10d::Backend>& delegate, const c10d::BarrierOptions& opts) {
  if (!delegate || !used_.exchange(false)) {
    return;
  }
  c10::intrusive_ptr<c10d::Work> work = delegate->barrier(opts);
  if (work) {
    work->wait();
  }
}

} // namespace fairring
