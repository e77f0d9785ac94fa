#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <mutex>
#include <vector>

namespace fairring {

// A point on the device that later work on the same memory must wait for: the
// end of one of the group's own operations (an event on one of its streams), or
// the end of a collective handed to the delegate (its Work). Nothing here makes
// the host wait.
class DonePoint {
 public:
  virtual ~DonePoint() = default;
  // Whether the device has passed it. Asks; never waits.
  virtual bool reached() = 0;
  // `stream` waits for it; the host does not.
  virtual void block(const c10::Stream& stream) = 0;
};

using Done = std::shared_ptr<DonePoint>;

// c10::Events made once and recorded again and again: a composed call records
// several per piece, and creating and destroying a CUDA event each time costs
// host time on the issuing thread. An event goes back to the pool when the last
// reference to it goes (a Work may hold one after the group is gone: the pool
// lives as long as any of its events).
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  using Event = std::shared_ptr<c10::Event>;

  explicit EventPool(c10::DeviceType type) : type_(type) {}

  // An event recorded at the current point of `stream`.
  Event record(const c10::Stream& stream);
  // How many events were ever created (a bound for tests).
  size_t created() const;

 private:
  const c10::DeviceType type_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<c10::Event>> free_;
  size_t created_{0};
};

// The end of one of the group's operations: an event of the pool.
class EventDone : public DonePoint {
 public:
  explicit EventDone(EventPool::Event event) : event_(std::move(event)) {}
  bool reached() override {
    return event_->query();
  }
  void block(const c10::Stream& stream) override {
    event_->block(stream);
  }
  const c10::Event& event() const {
    return *event_;
  }

 private:
  EventPool::Event event_;
};

// The end of a collective the delegate runs, from its Work, never through the
// Work's wait() or synchronize(): since torch 2.8 ProcessGroupNCCL holds an
// asynchronous collective's tensors until one of those is called and empties
// that hold there (it calls no record_stream), so calling either on a stream of
// ours at issue would free the caller's temporaries while NCCL still reads
// them. The future ProcessGroupNCCL marks at issue carries the end as CUDA
// events: waiting on it with a stream current only makes that stream wait.
//
// A future marked with no tensor carries no event, and waiting on it orders
// nothing: ProcessGroupNCCL's coalesced Works (endCoalescing: all_gather and
// reduce_scatter lists of uneven sizes, batch_isend_irecv) are marked with an
// empty list, and c10's Future::markCompleted records events only on the
// devices of its value's storages. For those the caller's current stream
// waits through the Work's own synchronize(), as the user's wait() would.
// That empties the Work's hold on the call's tensors (which may come from
// any stream's pool), so this keeps them itself (`held_`) for the composed
// call that waited, which tells the allocator of its own streams (each after
// the call's end) before they may go.
class WorkDone : public DonePoint {
 public:
  // `tensors`: the call's, held only where its future carries no event.
  WorkDone(c10::intrusive_ptr<c10d::Work> work, const std::vector<at::Tensor>& tensors);
  bool reached() override {
    return work_->isCompleted();
  }
  void block(const c10::Stream& stream) override;
  // Whether its future carries the call's end (block() orders a stream).
  bool carriesEvents() const;
  // The caller's current stream waits for the call's end (its synchronize());
  // returns the call's tensors, for the caller to keep alive on its streams.
  std::vector<at::Tensor> blockCallerStream();

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::vector<at::Tensor> held_;
};

} // namespace fairring
