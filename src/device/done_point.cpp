#include "device/done_point.h"

#include <c10/core/StreamGuard.h>

namespace fairring {

EventPool::Event EventPool::record(const c10::Stream& stream) {
  std::unique_ptr<c10::Event> event;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      event = std::move(free_.back());
      free_.pop_back();
    } else {
      ++created_;
    }
  }
  if (!event) {
    event = std::make_unique<c10::Event>(type_);
  }
  // Recording again replaces what the event marked; whoever waited on its
  // earlier record (a stream wait is captured when it is issued) is unaffected.
  event->record(stream);
  std::weak_ptr<EventPool> pool = weak_from_this();
  return Event(event.release(), [pool](c10::Event* e) {
    std::unique_ptr<c10::Event> owned(e);
    if (auto alive = pool.lock()) {
      std::lock_guard<std::mutex> lock(alive->mu_);
      alive->free_.push_back(std::move(owned));
    }
  });
}

size_t EventPool::created() const {
  std::lock_guard<std::mutex> lock(mu_);
  return created_;
}

bool WorkDone::carriesEvents() const {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work_->getFuture();
  } catch (const std::exception&) {
    return false; // a Work without a future (Gloo's send and recv): its synchronize() is all there is
  }
  if (!future || !future->completed() || future->hasError()) {
    return true; // block() waits for it on the host
  }
  return !future->storages().empty();
}

WorkDone::WorkDone(c10::intrusive_ptr<c10d::Work> work, const std::vector<at::Tensor>& tensors)
    : work_(std::move(work)) {
  if (!carriesEvents()) {
    held_ = tensors;
  }
}

std::vector<at::Tensor> WorkDone::blockCallerStream() {
  work_->synchronize();
  return held_;
}

void WorkDone::block(const c10::Stream& stream) {
  // c10's Future::wait() makes the current stream wait on the events it was
  // marked with (and records its values' storages there); ProcessGroupNCCL's
  // future is marked at issue, so nothing waits on the host. A delegate whose
  // future completes later (Gloo moving CUDA tensors through the host) is
  // waited for here on the host, as its own wait() would.
  c10::StreamGuard onStream(stream);
  work_->getFuture()->wait();
}

} // namespace fairring
