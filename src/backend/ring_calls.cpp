#include "backend/ring_calls.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

namespace fairring {

namespace {
c10::intrusive_ptr<c10::ivalue::Future> newFuture() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}
} // namespace

struct RingCalls::Call {
  uint64_t seq{0};
  Ring ring;
  c10::intrusive_ptr<c10::ivalue::Future> done{newFuture()};
  std::atomic<bool> settled{false};
  enum class Stage { kAnnouncing, kReady, kDropped } stage{Stage::kAnnouncing}; // under State::mu

  void fail(const std::string& message) {
    if (!settled.exchange(true)) {
      done->setError(std::make_exception_ptr(c10::DistBackendError(message)));
    }
  }
};

// Shared with the callbacks, which may outlive this object (an abandoned call
// ends on Gloo's thread whenever Gloo gives up on it). The lock guards only the
// queue: nothing that calls into the engine or Gloo runs under it, since either
// may run callbacks that take it.
struct RingCalls::State {
  CollectiveEngine* engine{nullptr};
  std::mutex mu;
  std::deque<std::shared_ptr<Call>> waiting; // in turn order, not on Gloo yet
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

RingCalls::RingCalls(CollectiveEngine& engine) : state_(std::make_shared<State>()) {
  state_->engine = &engine;
}

RingCalls::~RingCalls() {
  shutdown();
}

void RingCalls::shutdown() {
  state_->stopped = true;
  // A callback inside the engine finishes first (at most a failed call's wait
  // for the close of a lost peer, GroupFailure::kSendFailureWait).
  while (state_->using_.load() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->waiting.clear();
}

uint64_t RingCalls::abandoned() const {
  return state_->abandoned.load();
}

std::shared_ptr<const std::atomic<int>> RingCalls::inGloo() const {
  return state_->inGloo;
}

c10::intrusive_ptr<c10::ivalue::Future> RingCalls::issue(
    Ring ring,
    int64_t numel,
    at::ScalarType dtype,
    c10d::ReduceOp::RedOpType op) {
  CollectiveEngine* engine = state_->use();
  if (engine == nullptr) {
    throw c10::DistBackendError("fairring: the process group was shut down");
  }
  auto call = std::make_shared<Call>();
  call->ring = std::move(ring);
  c10::intrusive_ptr<c10::ivalue::Future> announced;
  try {
    announced = engine->announce(numel, dtype, op, call->seq); // the program's calls come one at a time
  } catch (...) {
    state_->release();
    throw;
  }
  state_->release();
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->waiting.push_back(call);
  }
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
  return call->done;
}

void RingCalls::startReady(const std::shared_ptr<State>& state) {
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
    }
  } while (state->again);
  state->draining = false;
}

void RingCalls::start(const std::shared_ptr<State>& state, const std::shared_ptr<Call>& call) {
  CollectiveEngine* engine = state->use();
  if (engine == nullptr) {
    call->fail("fairring: the process group was shut down");
    return;
  }
  std::weak_ptr<State> weak = state;
  // The group may fail while Gloo runs it: then it fails as the engine's calls
  // in flight do, and Gloo runs it on, for nobody.
  engine->watchTurn(call->seq, [weak, call](const std::string& message) {
    if (!call->settled.load()) {
      if (auto state = weak.lock()) {
        ++state->abandoned;
      }
    }
    call->fail(message);
  });
  c10::intrusive_ptr<c10::ivalue::Future> source;
  std::shared_ptr<std::atomic<int>> inGloo = state->inGloo;
  ++*inGloo;
  try {
    source = call->ring();
  } catch (const std::exception& e) {
    --*inGloo;
    call->fail(engine->turnFailed(call->seq, e.what()));
    state->release();
    return;
  }
  state->release();
  source->addCallback([weak, call, inGloo](c10::ivalue::Future& f) {
    --*inGloo;
    std::string failed = f.hasError() ? f.tryRetrieveErrorMessage() : "";
    auto state = weak.lock();
    CollectiveEngine* engine = state ? state->use() : nullptr;
    if (engine != nullptr) {
      if (f.hasError()) {
        // Its turn failed on this rank: it fails the group from there on,
        // with the lost peer named where the engine saw one go.
        failed = engine->turnFailed(call->seq, failed);
      } else {
        engine->turnDone(call->seq);
      }
      state->release();
    }
    if (f.hasError()) {
      call->fail(failed);
    } else if (!call->settled.exchange(true)) {
      call->done->markCompleted(f.value());
    }
  });
}

} // namespace fairring
