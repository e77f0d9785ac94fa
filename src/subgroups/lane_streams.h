#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <memory>
#include <optional>
#include <vector>

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
  LaneStreams(c10::Device device, int lanes);

  bool onDevice() const { return !streams_.empty(); }
  c10::Device device() const { return device_; }

  // An operation starts: remember where the caller's current stream stands.
  void beginOp();
  // Makes lane `lane`'s stream current until the guard goes; the lane's
  // first unit in this operation first waits for the caller's stream.
  c10::OptionalStreamGuard enter(int lane);
  // The caching allocator must not hand `t`'s memory out again before the
  // lane's stream has passed this point (the caller may free it at once).
  void keepAlive(const at::Tensor& t, int lane) const;
  // Joins the lanes this operation used on the stream of `last` (the lane of
  // its last unit) and makes that stream current until the guard goes.
  c10::OptionalStreamGuard join(int last);
  // An event recorded at the current point of lane `lane`'s stream (null on CPU).
  std::shared_ptr<c10::Event> mark(int lane) const;

  // Allocates `bytes` on the device with lane `lane`'s stream current, so
  // that the caching allocator orders the block's eventual release after the
  // lane's work.
  at::Tensor allocate(size_t bytes, int lane) const;

 private:
  c10::Device device_;
  std::vector<c10::Stream> streams_;
  std::optional<c10::Event> callerPosition_;
  std::vector<char> entered_; // per lane: has it waited on callerPosition_ in this op
};

} // namespace fairring
