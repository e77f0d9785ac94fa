#include "subgroups/lane_streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include "subgroups/drain.h"

namespace fairring {

LaneStreams::LaneStreams(c10::Device device, int lanes, bool localSteps) : device_(device), lanes_(lanes) {
  if (device.is_cpu()) {
    return;
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  const int count = lanes + (localSteps ? 2 : 0);
  for (int k = 0; k < count; ++k) {
    streams_.push_back(impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false));
  }
  entered_.assign(count, 0);
  watch_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
}

void LaneStreams::beginOp(Events after) {
  if (!onDevice()) {
    return;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  callerPosition_.emplace(device_.type());
  callerPosition_->record(impl.getStream(device_));
  after_ = std::move(after);
  std::fill(entered_.begin(), entered_.end(), 0);
}

c10::OptionalStreamGuard LaneStreams::enter(int index) {
  if (!onDevice()) {
    return c10::OptionalStreamGuard();
  }
  const c10::Stream& stream = streams_.at(index);
  if (!entered_[index]) {
    entered_[index] = 1;
    callerPosition_->block(stream);
    for (const auto& event : after_) {
      event->block(stream);
    }
  }
  return c10::OptionalStreamGuard(stream);
}

void LaneStreams::restartFrom(int index) {
  if (!onDevice()) {
    return;
  }
  callerPosition_.emplace(device_.type());
  callerPosition_->record(streams_.at(index));
  after_.clear(); // `index` has waited for them
}

void LaneStreams::wait(int index, const Event& event) const {
  if (onDevice() && event) {
    event->block(streams_.at(index));
  }
}

std::optional<c10::Stream> LaneStreams::stream(int index) const {
  if (!onDevice()) {
    return std::nullopt;
  }
  return streams_.at(index);
}

void LaneStreams::keepAlive(const at::Tensor& t, int index) const {
  if (!onDevice() || !t.defined() || !t.has_storage()) {
    return;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), streams_.at(index));
}

std::optional<c10::Stream> LaneStreams::join(int last) {
  if (!onDevice()) {
    return std::nullopt;
  }
  const c10::Stream& target = streams_.at(last);
  for (size_t k = 0; k < streams_.size(); ++k) {
    if (entered_[k] && static_cast<int>(k) != last) {
      c10::Event done(device_.type());
      done.record(streams_[k]);
      done.block(target);
    }
  }
  return target;
}

LaneStreams::Event LaneStreams::mark(int index) const {
  if (!onDevice()) {
    return nullptr;
  }
  auto event = std::make_shared<c10::Event>(device_.type());
  event->record(streams_.at(index));
  return event;
}

LaneStreams::Event LaneStreams::markAfter(const std::function<void()>& waitFor) const {
  if (!onDevice()) {
    return nullptr;
  }
  c10::StreamGuard onWatch(*watch_);
  waitFor();
  auto event = std::make_shared<c10::Event>(device_.type());
  event->record(*watch_);
  return event;
}

at::Tensor LaneStreams::allocate(size_t bytes, int index) const {
  auto options = at::TensorOptions().dtype(at::kByte).device(device_);
  if (!onDevice()) {
    return at::empty({static_cast<int64_t>(bytes)}, options);
  }
  c10::StreamGuard guard(streams_.at(index));
  return at::empty({static_cast<int64_t>(bytes)}, options);
}

void blockCurrentStream(const c10::Event& event, c10::Device device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  event.block(impl.getStream(device));
}

Status waitOnHost(
    const c10::Event& event,
    std::chrono::steady_clock::time_point deadline,
    const std::function<bool()>& stop) {
  const DrainEnd end = drainUntil({[&event] { return event.query(); }}, stop, deadline);
  switch (end) {
    case DrainEnd::kDrained:
      return Status();
    case DrainEnd::kFailed:
      return Status::error("the wait was stopped (the process group is being aborted)");
    case DrainEnd::kTimedOut:
      break;
  }
  return Status::error("the device did not get there in time");
}

} // namespace fairring
