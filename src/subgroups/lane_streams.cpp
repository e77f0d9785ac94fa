#include "subgroups/lane_streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include "faults/plants.h"
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
  pool_ = std::make_shared<EventPool>(device.type());
}

void LaneStreams::beginOp(std::vector<Done> after) {
  if (!onDevice()) {
    return;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  callerPosition_ = std::make_shared<EventDone>(pool_->record(impl.getStream(device_)));
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
    if (index >= lanes_ || !plants::planted(plants::Plant::kLaneSkipsCallerWait)) {
      callerPosition_->block(stream);
    }
    for (const auto& done : after_) {
      done->block(stream);
    }
  }
  return c10::OptionalStreamGuard(stream);
}

void LaneStreams::restartFrom(int index) {
  if (!onDevice()) {
    return;
  }
  callerPosition_ = mark(index);
  after_.clear(); // `index` has waited for them
}

void LaneStreams::wait(int index, const Done& done) const {
  if (onDevice() && done) {
    done->block(streams_.at(index));
  }
}

std::optional<c10::Stream> LaneStreams::stream(int index) const {
  if (!onDevice()) {
    return std::nullopt;
  }
  return streams_.at(index);
}

void LaneStreams::keepAlive(const at::Tensor& t, int index) const {
  if (!onDevice() || !t.defined() || !t.has_storage() || plants::planted(plants::Plant::kKeepAliveOff)) {
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
  for (size_t k = 0; k < streams_.size() && !plants::planted(plants::Plant::kLanesNotJoined); ++k) {
    if (entered_[k] && static_cast<int>(k) != last) {
      mark(static_cast<int>(k))->block(target);
    }
  }
  return target;
}

LaneStreams::Event LaneStreams::mark(int index) const {
  if (!onDevice()) {
    return nullptr;
  }
  return std::make_shared<EventDone>(pool_->record(streams_.at(index)));
}

at::Tensor LaneStreams::allocate(size_t bytes, int index) const {
  auto options = at::TensorOptions().dtype(at::kByte).device(device_);
  if (!onDevice()) {
    return at::empty({static_cast<int64_t>(bytes)}, options);
  }
  c10::StreamGuard guard(streams_.at(index));
  return at::empty({static_cast<int64_t>(bytes)}, options);
}

void blockCurrentStream(DonePoint& done, c10::Device device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  done.block(impl.getStream(device));
}

Status waitOnHost(
    DonePoint& done,
    std::chrono::steady_clock::time_point deadline,
    const std::function<bool()>& stop) {
  const DrainEnd end = drainUntil({[&done] { return done.reached(); }}, stop, deadline);
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
