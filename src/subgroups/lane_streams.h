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
#include "device/done_point.h"

namespace fairring {

// The streams of the sub-group path on one accelerator, through c10's
// device-generic stream and event interface (so this file needs no CUDA
// headers and compiles against a CPU build of torch, where it is inert).
//
// A stream per step: one per lane (the rail exchange of the pieces that lane
// carries), and with several local ranks one for the machine's
// reduce-scatters and one for its all-gathers. A sub-group collective issued
// while a stream is current starts after everything on that stream (NCCL's
// stream waits on the current one), and its work.wait() makes that stream
// wait for it, with no host synchronisation: each step of the pieces is in
// order on its stream, a step of a piece waits for the step before it
// through an event, and a lane's staging is reused by its next piece in the
// order of its stream.
//
// Streams are named by index: lanes 0..K-1, then the reduce-scatter stream
// and the all-gather stream. On a CPU device there are no streams: every
// method does nothing and the sub-group collectives' wait() blocks instead.
class LaneStreams {
 public:
  using Event = std::shared_ptr<EventDone>;

  LaneStreams(c10::Device device, int lanes, bool localSteps);

  bool onDevice() const { return !streams_.empty(); }
  c10::Device device() const { return device_; }
  int reduceScatterStream() const { return lanes_; }
  int allGatherStream() const { return lanes_ + 1; }

  // An operation starts: remember where the caller's current stream stands.
  // Each stream's first use in this operation waits for that point and for
  // `after` (earlier operations on the same memory, which other streams may
  // still be running).
  void beginOp(std::vector<Done> after = {});
  // Makes stream `index` current until the guard goes; its first use in this
  // operation first waits as beginOp said.
  c10::OptionalStreamGuard enter(int index);
  // What stream `index` has been given so far in this operation (a dense copy
  // of the caller's view, say) comes first for the streams not entered yet:
  // their first use waits for this point of `index` instead of the caller's
  // (which `index` has waited for).
  void restartFrom(int index);
  // Stream `index` waits for `done` (a step of another stream before it).
  void wait(int index, const Done& done) const;
  // The caching allocator must not hand `t`'s memory out again before stream
  // `index` has passed this point (the caller may free it at once).
  void keepAlive(const at::Tensor& t, int index) const;
  // Joins the streams this operation used on stream `last`: the stream on
  // which the operation is done (none on CPU).
  std::optional<c10::Stream> join(int last);
  // Stream `index` itself (none on CPU).
  std::optional<c10::Stream> stream(int index) const;
  // An event recorded at the current point of stream `index` (null on CPU),
  // from the group's pool.
  Event mark(int index) const;
  // How many events the pool has made (a bound: not one per step).
  size_t eventsCreated() const {
    return pool_ ? pool_->created() : 0;
  }

  // Allocates `bytes` on the device with stream `index` current, so that the
  // caching allocator orders the block's eventual release after its work.
  at::Tensor allocate(size_t bytes, int index) const;

 private:
  c10::Device device_;
  int lanes_;
  std::vector<c10::Stream> streams_; // lanes, then reduce-scatter and all-gather
  std::shared_ptr<EventPool> pool_;
  Event callerPosition_;
  std::vector<Done> after_;
  std::vector<char> entered_; // per stream: has it waited on callerPosition_ in this op
};

// Makes the caller's current stream on `device` wait for `done`.
void blockCurrentStream(DonePoint& done, c10::Device device);

// Waits on the host until the device has passed `event`, or `deadline` (which
// is an error). Polls, so that a peer that never comes cannot hold the
// caller forever, as a plain synchronize would.
// `stop` ends the wait early (an abort), as an error.
Status waitOnHost(
    DonePoint& done,
    std::chrono::steady_clock::time_point deadline,
    const std::function<bool()>& stop = [] { return false; });

} // namespace fairring
