#include "cpu/future_work.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <string>

namespace fairring {

FutureWork::FutureWork(
    int rank,
    c10d::OpType opType,
    const char* profilingTitle,
    const std::vector<at::Tensor>& inputs,
    c10::intrusive_ptr<c10::ivalue::Future> future)
    : c10d::Work(rank, opType, nullptr, inputs),
      future_(std::move(future)),
      signal_(std::make_shared<Signal>()) {
  // A torch.profiler range from issue to completion. c10d::Work would end its
  // own range in finish(), which this future-driven Work never calls.
  auto range = std::make_shared<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (range->isActive()) {
    range->_setAsync();
    std::vector<c10::IValue> shapes(inputs.begin(), inputs.end());
    range->before(profilingTitle, c10::ArrayRef<const c10::IValue>(shapes.data(), shapes.size()));
    future_->addCallback([range](c10::ivalue::Future&) { range->end(); });
  }
  // The future has no timed wait; a callback turns completion into a signal.
  future_->addCallback([signal = signal_](c10::ivalue::Future&) {
    {
      std::lock_guard<std::mutex> lock(signal->mu);
      signal->done = true;
    }
    signal->cv.notify_all();
  });
}

bool FutureWork::isCompleted() {
  return future_->completed();
}

bool FutureWork::isSuccess() const {
  return future_->completed() && !future_->hasError();
}

std::exception_ptr FutureWork::exception() const {
  return future_->completed() && future_->hasError() ? future_->exception_ptr() : nullptr;
}

std::vector<at::Tensor> FutureWork::result() {
  // A Gloo call's list of output lists (gather, all_gather_coalesced): its
  // first, as Gloo's own Work gives it.
  const c10::IValue& value = future_->value();
  if (value.isList() && !value.isTensorList()) {
    const auto lists = value.toListRef();
    return lists.empty() ? std::vector<at::Tensor>{} : lists[0].toTensorVector();
  }
  return value.toTensorVector();
}

bool FutureWork::wait(std::chrono::milliseconds timeout) {
  {
    std::unique_lock<std::mutex> lock(signal_->mu);
    if (timeout == kNoTimeout) {
      signal_->cv.wait(lock, [&] { return signal_->done; });
    } else if (!signal_->cv.wait_for(lock, timeout, [&] { return signal_->done; })) {
      throw c10::DistBackendError(
          "fairring: Work.wait() timed out after " + std::to_string(timeout.count()) + " ms");
    }
  }
  if (future_->hasError()) {
    std::rethrow_exception(future_->exception_ptr());
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> FutureWork::getFuture() {
  return future_;
}

} // namespace fairring
