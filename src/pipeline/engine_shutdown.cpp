// Shutting down: one engine (a destroy, the destructor) or every engine of
// the process (interpreter exit). Both fail what is in flight and close the
// connections once the aborts are out.

#include <algorithm>
#include <set>

#include "pipeline/collective_engine.h"
#include "pipeline/ordered_completion.h"

namespace fairring {

using Clock = std::chrono::steady_clock;

namespace {
std::mutex gRegistryMu;
std::set<CollectiveEngine*>& registry() {
  static auto* engines = new std::set<CollectiveEngine*>(); // never destroyed: used at exit
  return *engines;
}
} // namespace

void CollectiveEngine::enlist(CollectiveEngine* engine) {
  std::lock_guard<std::mutex> lock(gRegistryMu);
  registry().insert(engine);
}

CollectiveEngine::~CollectiveEngine() {
  {
    std::lock_guard<std::mutex> lock(gRegistryMu);
    registry().erase(this);
  }
  shutdown();
}

void CollectiveEngine::shutdownAll(std::chrono::milliseconds grace) {
  std::lock_guard<std::mutex> lock(gRegistryMu);
  const auto deadline = Clock::now() + grace;
  for (CollectiveEngine* engine : registry()) {
    std::unique_lock<std::mutex> engineLock(engine->mu_);
    const Locked locked(engineLock);
    engine->cv_.wait_until(engineLock, deadline, [&] { return engine->ledger_.empty(locked); });
  }
  for (CollectiveEngine* engine : registry()) {
    engine->shutdown();
  }
  // The shutdowns failed what was left; its futures' callbacks run on the
  // completion threads, which must be done before Python finalizes.
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  OrderedCompletion::stopAll(std::max(left, std::chrono::milliseconds(1000)));
}

void CollectiveEngine::shutdown() {
  bool closedEarlier = false; // by the watchdog, which stops now
  {
    std::unique_lock<std::mutex> lock(mu_);
    Locked locked(lock);
    if (life_.is(EngineLife::kShutDown)) {
      return;
    }
    closedEarlier = life_.is(EngineLife::kClosed);
    life_.moveTo(EngineLife::kShutDown);
    failLocked("fairring: the process group was shut down while this operation was in flight", locked);
    cv_.notify_all();
    locked.release();
  }
  // Closing the connections interrupts a start() still connecting; it then
  // starts no watchdog (kShutDown).
  mesh_->interrupt();
  std::thread watchdog;
  {
    std::lock_guard<std::mutex> lock(mu_);
    watchdog.swap(watchdog_);
  }
  if (watchdog.joinable()) {
    watchdog.join();
  }
  {
    // A rank that refused a call and destroys the group at once: the reason must
    // reach its peers before they see it close, or they report the close instead.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, failure_.abortsDeadline(Clock::now()), [this, closedEarlier] {
      return closedEarlier || failure_.mayClose(Clock::now());
    });
  }
  mesh_->close();
  tasks_.stop();
  timeline_.close();
  std::unique_lock<std::mutex> lock(mu_);
  ledger_.freeBuried(Locked(lock));
}

} // namespace fairring
