#include "backend/delegate_path.h"

#include <c10/util/Exception.h>

namespace fairring {

c10::intrusive_ptr<c10d::Work> DelegatePath::delegated(const std::vector<at::Tensor>& tensors, const Issue& issue) {
  TORCH_CHECK(delegate_, "fairring: rank ", rank_, ": ", unavailable_);
  barrier_.used();
  return issue(*delegate_);
}

void DelegatePath::awaitIssued(const c10d::BarrierOptions& opts) {
  barrier_.await(delegate_, opts);
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
