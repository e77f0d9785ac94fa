#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <memory>

namespace fairring {

// Completes the futures that users hold, in the order the operations were
// issued, on threads of its own (never an engine's), with their callbacks run
// one future at a time in that order. docs/design.md ("Completion order and
// comm hooks") has the rule and why it holds; in short:
//
//  - Futures are marked in issue order: the next one once the previous one is
//    marked, not once its callbacks have returned. Marking releases wait()
//    before any callback runs, so a callback blocked on a later future never
//    holds that future back.
//  - Each marking runs on a worker thread, and chain() adds a gate to every
//    future, which holds the callbacks added after it until every earlier
//    future's callbacks have returned. Workers are added when every one is
//    held (by a gate or by a callback that blocks).
class OrderedCompletion {
 public:
  using Future = c10::ivalue::Future;

  // After `patience` (the process group's timeout) a gate lets its callbacks
  // run out of order rather than wait forever (see gate()).
  explicit OrderedCompletion(std::chrono::milliseconds patience);
  ~OrderedCompletion();
  OrderedCompletion(const OrderedCompletion&) = delete;
  OrderedCompletion& operator=(const OrderedCompletion&) = delete;

  // `user` completes with `source`'s value or error, after every future chained
  // before it. Call in issue order, before `user` is handed out (callbacks
  // added to `user` so far run before the gate, so they must not block).
  void chain(const c10::intrusive_ptr<Future>& source, const c10::intrusive_ptr<Future>& user);

  // Whether the calling thread is one of the workers, i.e. running a
  // callback of a chained future.
  static bool onWorkerThread();

  // For a callback that runs outside the workers (attached after its future
  // was complete, so run at once by the thread that attached it): returns
  // once the callbacks of every future marked so far have returned, so that
  // what it issues follows what they issued, as on a worker. Gives way after
  // the patience, like a gate.
  void awaitMarkedCallbacks();

  // Gives chained futures and callbacks in progress up to `grace` to finish,
  // then stops: waiting gates are released, idle workers joined, a worker
  // still inside a callback is left to finish it on its own. Idempotent.
  void stop(std::chrono::milliseconds grace);

  // stop() on every instance of this process (interpreter exit).
  static void stopAll(std::chrono::milliseconds grace);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

} // namespace fairring
