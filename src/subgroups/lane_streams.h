#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "common/status.h"

namespace fairring {

// The streams of the sub-group path on one accelerator, through c10's
// device-generic stream and event interface (so this file needs no CUDA
// headers and compiles against a CPU build of torch, where it is inert).
//
// Each lane has a stream of its own. A sub-group collective issued while a
// lane's stream is current starts after everything on that stream (NCCL's
// stream waits on the current one), and its work.wait() makes that stream
// wait for it: the steps of a slice are ordered on its lane's stream, and
// so is the reuse of the lane's staging by the next slice of the lane, with
// no host synchronisation at all.
//
// On a CPU device there are no streams: every method does nothing and the
// sub-group collectives' wait() blocks instead.
class LaneStreams {
 public:
  using Events = std::vector<std::shared_ptr<c10::Event>>;

  LaneStreams(c10::Device device, int lanes);

  bool onDevice() const { return !streams_.empty(); }
  c10::Device device() const { return device_; }

  // An operation starts: remember where the caller's current stream stands.
  // Each lane's first unit in this operation waits for that point and for
  // `after` (earlier operations on the same memory, which other lanes may
  // still be running).
  void beginOp(Events after = {});
  // Makes lane `lane`'s stream current until the guard goes; the lane's
  // first unit in this operation first waits as beginOp said.
  c10::OptionalStreamGuard enter(int lane);
  // What lane `lane` has been given so far in this operation (a dense copy of
  // the caller's view, say) comes first for the lanes not entered yet: their
  // first unit waits for this point of `lane`'s stream instead of the
  // caller's (which `lane` has waited for).
  void restartFrom(int lane);
  // The caching allocator must not hand `t`'s memory out again before the
  // lane's stream has passed this point (the caller may free it at once).
  void keepAlive(const at::Tensor& t, int lane) const;
  // Joins the lanes this operation used on the stream of `last` (the lane of
  // its last unit): the stream on which the operation is done (none on CPU).
  std::optional<c10::Stream> join(int last);
  // An event recorded at the current point of lane `lane`'s stream (null on CPU).
  std::shared_ptr<c10::Event> mark(int lane) const;
  // `waitFor()` run with a stream of the group's own current (it makes that
  // stream wait for work of another group), then an event there: the point
  // where that work ends, for later operations to wait on.
  std::shared_ptr<c10::Event> markAfter(const std::function<void()>& waitFor) const;

  // Allocates `bytes` on the device with lane `lane`'s stream current, so
  // that the caching allocator orders the block's eventual release after the
  // lane's work.
  at::Tensor allocate(size_t bytes, int lane) const;

 private:
  c10::Device device_;
  std::vector<c10::Stream> streams_;
  std::optional<c10::Stream> watch_; // waits for the delegate's collectives (markAfter)
  std::optional<c10::Event> callerPosition_;
  Events after_;
  std::vector<char> entered_; // per lane: has it waited on callerPosition_ in this op
};

// Makes the caller's current stream on the device of `event` wait for it.
void blockCurrentStream(const c10::Event& event, c10::Device device);

// Waits on the host until the device has passed `event`, or `deadline` (which
// is an error). Polls, so that a peer that never comes cannot hold the
// caller forever, as a plain synchronize would.
// `stop` ends the wait early (an abort), as an error.
Status waitOnHost(
    const c10::Event& event,
    std::chrono::steady_clock::time_point deadline,
    const std::function<bool()>& stop = [] { return false; });

} // namespace fairring
