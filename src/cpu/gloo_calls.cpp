#include "cpu/gloo_calls.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <string>
#include <thread>

#include "faults/fault_points.h"

namespace fairring {

namespace {

// Whether a handed-over call's error is an argument check of torch's, made
// before Gloo sent anything (torch 2.13 checks all_to_all's split sizes on
// Gloo's worker thread, 2.14 at the call): a plain c10::Error, not a
// DistError or Gloo's own. Gloo's pairs are intact, so the call raises it
// and the group goes on, as with Gloo alone.
bool refusedBeforeSending(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::DistError&) {
    return false;
  } catch (const c10::Error&) {
    return true;
  } catch (...) {
    return false;
  }
}

c10::intrusive_ptr<c10::ivalue::Future> newFuture() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}
} // namespace

struct GlooCalls::Call {
  uint64_t seq{0};
  bool announced{true}; // took turn `seq` on the engine
  Start start;
  c10::intrusive_ptr<c10::ivalue::Future> done{newFuture()};
  std::atomic<bool> settled{false};
  enum class Stage { kAnnouncing, kReady, kDropped } stage{Stage::kAnnouncing}; // under State::mu

  void fail(const std::string& message) {
    failWith(std::make_exception_ptr(c10::DistBackendError(message)));
  }
  void failWith(std::exception_ptr error) {
    if (!settled.exchange(true)) {
      done->setError(std::move(error));
    }
  }
};

// Shared with the callbacks, which may outlive this object (an abandoned call
// ends on Gloo's thread whenever Gloo gives up on it). The lock guards only the
// queue: nothing that calls into the engine or Gloo runs under it, since either
// may run callbacks that take it.
struct GlooCalls::State {
  CollectiveEngine* engine{nullptr};
  std::mutex mu;
  std::deque<std::shared_ptr<Call>> waiting; // in issue order, not on Gloo yet
  uint64_t issued{0}; // calls queued so far
  uint64_t handed{0}; // of them, on Gloo or dropped
  std::condition_variable handedOver;
  bool draining{false}; // one thread hands calls to Gloo at a time, in order
  bool again{false};
  std::atomic<bool> stopped{false};
  std::atomic<int> using_{0}; // callbacks inside the engine right now
  std::atomic<uint64_t> abandoned{0};
  std::shared_ptr<std::atomic<int>> inGloo{std::make_shared<std::atomic<int>>(0)};

  // The engine, or null once shut down; counted until release().
  CollectiveEngine* use() {
    ++using_;
    if (stopped.load()) {
      --using_;
      return nullptr;
    }
    return engine;
  }
  void release() {
    --using_;
  }
};

GlooCalls::GlooCalls(CollectiveEngine& engine) : state_(std::make_shared<State>()) {
  state_->engine = &engine;
}

GlooCalls::~GlooCalls() {
  shutdown();
}

void GlooCalls::shutdown() {
  state_->stopped = true;
  // A callback inside the engine finishes first (at most a failed call's wait
  // for the close of a lost peer, GroupFailure::kSendFailureWait).
  while (state_->using_.load() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->waiting.clear();
  state_->handedOver.notify_all();
}

uint64_t GlooCalls::abandoned() const {
  return state_->abandoned.load();
}

std::shared_ptr<const std::atomic<int>> GlooCalls::inGloo() const {
  return state_->inGloo;
}

c10::intrusive_ptr<c10::ivalue::Future> GlooCalls::issue(Start start, const Announced& what) {
  CollectiveEngine* engine = state_->use();
  if (engine == nullptr) {
    throw c10::DistBackendError("fairring: the process group was shut down");
  }
  auto call = std::make_shared<Call>();
  call->start = std::move(start);
  c10::intrusive_ptr<c10::ivalue::Future> announced;
  try {
    announced = engine->announce(what, call->seq); // the program's calls come one at a time
  } catch (...) {
    state_->release();
    throw;
  }
  state_->release();
  auto done = queue(call);
  std::weak_ptr<State> weak = state_;
  announced->addCallback([weak, call](c10::ivalue::Future& f) {
    auto state = weak.lock();
    if (!state) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(state->mu);
      call->stage = f.hasError() ? Call::Stage::kDropped : Call::Stage::kReady;
    }
    if (f.hasError()) {
      call->fail(f.tryRetrieveErrorMessage()); // the ranks disagree, or the group failed
    }
    startReady(state);
  });
  return done;
}

c10::intrusive_ptr<c10::ivalue::Future> GlooCalls::issueUnannounced(Start start) {
  if (state_->stopped.load()) {
    throw c10::DistBackendError("fairring: the process group was shut down");
  }
  auto call = std::make_shared<Call>();
  call->start = std::move(start);
  call->announced = false;
  call->stage = Call::Stage::kReady;
  auto done = queue(call);
  startReady(state_);
  return done;
}

c10::intrusive_ptr<c10::ivalue::Future> GlooCalls::queue(const std::shared_ptr<Call>& call) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->waiting.push_back(call);
  ++state_->issued;
  return call->done;
}

void GlooCalls::awaitHandedOver() {
  std::unique_lock<std::mutex> lock(state_->mu);
  const uint64_t target = state_->issued;
  state_->handedOver.wait(lock, [&] { return state_->handed >= target || state_->stopped.load(); });
}

void GlooCalls::startReady(const std::shared_ptr<State>& state) {
  std::unique_lock<std::mutex> lock(state->mu);
  if (state->draining) {
    state->again = true; // the thread draining now starts it, in turn
    return;
  }
  state->draining = true;
  do {
    state->again = false;
    while (!state->waiting.empty() && state->waiting.front()->stage != Call::Stage::kAnnouncing) {
      auto call = std::move(state->waiting.front());
      state->waiting.pop_front();
      if (call->stage == Call::Stage::kReady) {
        lock.unlock();
        start(state, call);
        lock.lock();
      }
      ++state->handed;
      state->handedOver.notify_all();
    }
  } while (state->again);
  state->draining = false;
}

void GlooCalls::start(const std::shared_ptr<State>& state, const std::shared_ptr<Call>& call) {
  faults::hit(faults::kGlooHandOver); // before use(): a late hand-over holds no destroy
  CollectiveEngine* engine = state->use();
  if (engine == nullptr) {
    call->fail("fairring: the process group was shut down");
    return;
  }
  std::weak_ptr<State> weak = state;
  // The group may fail while Gloo runs it: then it fails as the engine's calls
  // in flight do, and Gloo runs it on, for nobody.
  if (call->announced) {
    engine->watchTurn(call->seq, [weak, call](const std::string& message) {
      if (!call->settled.load()) {
        if (auto state = weak.lock()) {
          ++state->abandoned;
        }
      }
      call->fail(message);
    });
  }
  c10::intrusive_ptr<c10::ivalue::Future> source;
  std::shared_ptr<std::atomic<int>> inGloo = state->inGloo;
  ++*inGloo;
  try {
    Start handOver = std::move(call->start); // what it holds is freed here, not on Gloo's thread
    source = handOver();
  } catch (const std::exception&) {
    // Gloo refused it at issue (an argument it checks, a collective it lacks),
    // as it would the program's own call on every rank alike: the call raises
    // Gloo's own error and the group goes on.
    --*inGloo;
    if (call->announced) {
      engine->turnDone(call->seq);
    }
    call->failWith(std::current_exception());
    state->release();
    return;
  }
  state->release();
  source->addCallback([weak, call, inGloo](c10::ivalue::Future& f) {
    --*inGloo;
    std::string failed = f.hasError() ? f.tryRetrieveErrorMessage() : "";
    const bool refused = f.hasError() && refusedBeforeSending(f.exception_ptr());
    auto state = weak.lock();
    CollectiveEngine* engine = state && call->announced ? state->use() : nullptr;
    if (engine != nullptr) {
      if (f.hasError() && !refused) {
        // Its turn failed on this rank: it fails the group from there on,
        // with the lost peer named where the engine saw one go.
        failed = engine->turnFailed(call->seq, failed);
      } else {
        engine->turnDone(call->seq);
      }
      state->release();
    }
    if (refused) {
      call->failWith(f.exception_ptr()); // Gloo's own error, as at issue
    } else if (f.hasError()) {
      call->fail(failed);
    } else if (!call->settled.exchange(true)) {
      call->done->markCompleted(f.value());
    }
  });
}

} // namespace fairring
