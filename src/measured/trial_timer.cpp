#include "measured/trial_timer.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "faults/fault_points.h"
#include "faults/plants.h"
#include "device/done_point.h"

namespace fairring {

namespace {

// Polls of a wait: short enough to end soon after a stop, long enough to cost nothing.
constexpr std::chrono::milliseconds kPoll{5};

TrialTime gaveUp(bool stopped) {
  return TrialTime{
      false, std::nullopt,
      stopped ? "the process group was stopped" : "the call did not end within the process group's timeout"};
}

// The clock, from issue to the call's future's completion.
class HostTimer : public TrialTimer, public std::enable_shared_from_this<HostTimer> {
 public:
  explicit HostTimer(int64_t call) : call_(call), start_(Clock::now()) {}

  void watch(const c10::intrusive_ptr<c10d::Work>& work) override {
    if (!work && !plants::planted(plants::Plant::kTrialTimesNoWork)) {
      finish(""); // a synchronous call: done when it returned
      return;
    }
    watch(work->getFuture());
  }
  void watch(const c10::intrusive_ptr<c10::ivalue::Future>& future) override {
    future->addCallback([self = shared_from_this()](c10::ivalue::Future& f) {
      self->finish(f.hasError() ? f.tryRetrieveErrorMessage() : std::string());
    });
  }
  void raised(const std::string& what) override {
    finish("the call raised: " + what);
  }
  void began() override {
    std::lock_guard<std::mutex> lock(mu_);
    start_ = Clock::now();
  }

  TrialTime read(Clock::time_point deadline, const Stop& stop) override {
    std::unique_lock<std::mutex> lock(mu_);
    while (!done_) {
      if (stop() || Clock::now() >= deadline) {
        return gaveUp(stop());
      }
      ended_.wait_for(lock, kPoll);
    }
    if (!error_.empty()) {
      return TrialTime{true, std::nullopt, error_};
    }
    return TrialTime{true, std::chrono::duration<double>(end_ - start_).count(), ""};
  }

 private:
  void finish(std::string error) {
    // Tests: this rank's trial call ends late (its decision must wait for it).
    // Late on a thread of its own: the thread that completes the call's future
    // (the engine's) goes on with the calls after it, the ring's turns too.
    if (auto late = faults::at(faults::kMeasuredTrialDone, call_)) {
      if (late->action == faults::Action::kThrow) {
        end("its timer failed (a test's fault point)"); // tests: this rank cannot time it
        return;
      }
      std::thread([self = shared_from_this(), delay = late->delay, error = std::move(error)]() mutable {
        std::this_thread::sleep_for(delay);
        self->end(std::move(error));
      }).detach();
      return;
    }
    end(std::move(error));
  }

  void end(std::string error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) {
      return;
    }
    end_ = Clock::now();
    error_ = std::move(error);
    done_ = true;
    ended_.notify_all();
  }

  const int64_t call_;
  Clock::time_point start_; // under mu_ once the call was issued
  std::mutex mu_;
  std::condition_variable ended_;
  bool done_{false};
  Clock::time_point end_;
  std::string error_;
};

// Timing events: the start on the caller's stream at issue, the end on the
// timers' own stream once it has waited for the call's end (its Work's
// future, which carries that end as events: the host never waits).
class DeviceTimer : public TrialTimer {
 public:
  DeviceTimer(c10::Device device, c10::Stream timing)
      : device_(device), timing_(timing), start_(device.type(), c10::EventFlag::BACKEND_DEFAULT),
        end_(device.type(), c10::EventFlag::BACKEND_DEFAULT) {
    start_.record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }

  void watch(const c10::intrusive_ptr<c10d::Work>& work) override {
    if (!work && !plants::planted(plants::Plant::kTrialTimesNoWork)) {
      // A synchronous call ran on the caller's current stream: it ends where
      // that stream is now.
      end_.record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
      recorded_ = true;
      return;
    }
    WorkDone(work, {}).block(timing_);
    end_.record(timing_);
    recorded_ = true;
  }
  void watch(const c10::intrusive_ptr<c10::ivalue::Future>& future) override {
    TORCH_CHECK(false, "fairring: a device's trial call is timed from its Work");
  }
  void raised(const std::string& what) override {
    error_ = "the call raised: " + what;
  }

  TrialTime read(Clock::time_point deadline, const Stop& stop) override {
    if (!recorded_) {
      return TrialTime{true, std::nullopt, error_.empty() ? "the call was never issued" : error_};
    }
    // Asked only now: a query per call would cost the calls a driver call each.
    while (!end_.query()) {
      if (stop() || Clock::now() >= deadline) {
        return gaveUp(stop());
      }
      std::this_thread::sleep_for(kPoll);
    }
    try {
      return TrialTime{true, start_.elapsedTime(end_) / 1000.0, ""};
    } catch (const std::exception& e) {
      return TrialTime{true, std::nullopt, std::string("the device cannot time events: ") + e.what()};
    }
  }

 private:
  const c10::Device device_;
  const c10::Stream timing_;
  c10::Event start_;
  c10::Event end_;
  bool recorded_{false};
  std::string error_;
};

// A device's timer where no stream of its own could be made: it cannot time
// (the class keeps the program's own way, saying why).
class UntimedTimer : public TrialTimer {
 public:
  explicit UntimedTimer(std::string why) : why_(std::move(why)) {}

  void watch(const c10::intrusive_ptr<c10d::Work>&) override {}
  void watch(const c10::intrusive_ptr<c10::ivalue::Future>&) override {}
  void raised(const std::string&) override {}
  TrialTime read(Clock::time_point, const Stop&) override {
    return TrialTime{true, std::nullopt, why_};
  }

 private:
  const std::string why_;
};

} // namespace

TrialTimers::TrialTimers(StreamMaker ownStream) : ownStream_(std::move(ownStream)) {}

TrialTimers::Timing TrialTimers::make(c10::Device device) const {
  if (plants::planted(plants::Plant::kTimerOnPoolStream)) {
    // Tests: what the device calls a new stream (on CUDA, one of torch's pool).
    return Timing{c10::impl::VirtualGuardImpl(device.type()).getNewStream(device), ""};
  }
  const std::string what = "no stream of its own on " + device.str() + " to time its calls on: ";
  if (!ownStream_) {
    return Timing{std::nullopt, what + "fairring_pg.cuda.own_stream knows no way to make one"};
  }
  try {
    return Timing{ownStream_(device), ""};
  } catch (const std::exception& e) {
    return Timing{std::nullopt, what + e.what()};
  }
}

std::shared_ptr<TrialTimer> TrialTimers::start(int64_t call, c10::Device device) {
  if (device.is_cpu()) {
    return std::make_shared<HostTimer>(call);
  }
  if (!device.has_index()) {
    device = c10::impl::VirtualGuardImpl(device.type()).getDevice();
  }
  std::unique_lock<std::mutex> lock(mu_);
  auto it = timing_.find(device.index());
  if (it == timing_.end()) {
    // Made without the lock: the maker may take the GIL, and a thread that
    // holds it may be starting a timer too. A second one made at once is
    // left unused.
    lock.unlock();
    Timing made = make(device);
    lock.lock();
    it = timing_.emplace(device.index(), std::move(made)).first;
  }
  if (!it->second.stream) {
    return std::make_shared<UntimedTimer>(it->second.why);
  }
  return std::make_shared<DeviceTimer>(device, *it->second.stream);
}

} // namespace fairring
