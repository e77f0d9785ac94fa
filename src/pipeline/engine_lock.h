#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <mutex>
#include <utility>
#include <vector>

namespace fairring {

// The engine's lock, held, and what to do once it is released. What the
// engine decides under its lock that may block or call back in (a send, a
// receive, a future's callbacks, the failure of a call on Gloo) is queued
// with later() and run by release() or flush(), in order, with the lock
// released. The engine's parts (TurnLedger, Inbox, OutsideTurns) take a
// Locked in every method that reads or changes their state: a caller that
// does not hold the lock has none to give, and the compiler says so.
class Locked {
 public:
  explicit Locked(std::unique_lock<std::mutex>& lock) : lock_(lock) {
    TORCH_INTERNAL_ASSERT(lock_.owns_lock(), "fairring: a Locked made without its lock");
  }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;

  void later(std::function<void()> action) {
    actions_.push_back(std::move(action));
  }

  // Releases the lock for good and runs what was queued.
  void release() {
    lock_.unlock();
    run();
  }

  // Releases the lock, runs what was queued, and takes the lock again.
  void flush() {
    if (!actions_.empty()) {
      unlocked([this] { run(); });
    }
  }

  // Runs `f` with the lock released (a wait that must not hold it), then
  // takes it again: what the caller read under it may have changed.
  template <typename F>
  void unlocked(F&& f) {
    lock_.unlock();
    f();
    lock_.lock();
  }

 private:
  void run() {
    std::vector<std::function<void()>> actions = std::move(actions_);
    actions_.clear();
    for (auto& a : actions) {
      a();
    }
  }

  std::unique_lock<std::mutex>& lock_;
  std::vector<std::function<void()>> actions_;
};

} // namespace fairring
