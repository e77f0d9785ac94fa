#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace fairring {

// What one timed trial call took on this rank, once it is done.
struct TrialTime {
  bool done{false}; // the call finished (well or not) before the wait gave up
  std::optional<double> seconds; // empty: it failed, or could not be timed (error says why)
  std::string error;
};

// How long one timed trial call of the measured choice takes on this rank:
// started just before the call is issued, told what to watch once it is, and
// read only at its class's decision (so timing costs the calls nothing: no
// host wait, no query). A call on the host (CPU tensors) is timed with the
// clock, from its issue to its future's completion; one on a device with
// timing events, from the caller's stream at issue to the call's end, which a
// stream of the timer's own waits for (the caller's streams never do).
class TrialTimer {
 public:
  using Clock = std::chrono::steady_clock;
  using Stop = std::function<bool()>;

  virtual ~TrialTimer() = default;
  // The call was issued: `work` is its Work (its future marks its end), or
  // null for a synchronous call, which returns none (ProcessGroupNCCL with
  // asyncOp false, torch's distributed_c10d.py: "the backend has sync'ed at
  // CPP level"): it ran on the caller's current stream, or on the host, and
  // its end is there.
  virtual void watch(const c10::intrusive_ptr<c10d::Work>& work) = 0;
  // The call was issued: `future` completes when it ends (host calls only).
  virtual void watch(const c10::intrusive_ptr<c10::ivalue::Future>& future) = 0;
  // The call's own work starts now, later than the timer did (a host call
  // handed over once its turn comes: Gloo's ring after its announcement).
  virtual void began() {}
  // The call raised instead of being issued.
  virtual void raised(const std::string& what) = 0;
  // Waits, holding no lock and polling, until the call is done, `deadline`
  // passes or `stop` says so.
  virtual TrialTime read(Clock::time_point deadline, const Stop& stop) = 0;
};

// Makes a stream on `device` that no one else is handed, or throws why it
// cannot. CUDA's own "new stream" is one of a pool of 32 that torch hands
// round robin to every caller (CUDAGuardImpl::getNewStream calls
// getStreamFromPool), the program's torch.cuda.Stream() too: a timer's wait
// there would hold back whatever the program runs on it later.
// fairring_pg.cuda.own_stream makes them (a non-blocking stream of the driver's).
using StreamMaker = std::function<c10::Stream(c10::Device)>;

// Makes the timers of one device's calls: the clock on CPU, events on an
// accelerator, whose ends are recorded on one stream per device, made at its
// first timer by `ownStream`. Where there is none (no maker, or it failed),
// that device's timers cannot time: its classes keep the program's own way,
// saying why.
class TrialTimers {
 public:
  explicit TrialTimers(StreamMaker ownStream = {});

  // A timer for trial call `call` of its class, on `device` (the call's
  // tensors'); `call` is the key of the test-only fault point
  // "measured.trial_done", which makes that call end late.
  // Any thread may ask (a program issues a device's calls from several).
  std::shared_ptr<TrialTimer> start(int64_t call, c10::Device device);

 private:
  // The stream of a device's timers, or why it has none.
  struct Timing {
    std::optional<c10::Stream> stream;
    std::string why;
  };
  Timing make(c10::Device device) const;

  const StreamMaker ownStream_;
  std::mutex mu_;
  std::map<c10::DeviceIndex, Timing> timing_; // per device index, under mu_
};

} // namespace fairring
