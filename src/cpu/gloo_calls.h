#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "pipeline/announced.h"
#include "pipeline/collective_engine.h"

namespace fairring {

// The calls handed to one Gloo group: the program's allreduces on Gloo's ring
// (one rank per machine, FAIRRING_CPU_ALLREDUCE), or its collectives that
// fairring does not run (broadcast, gather, ...: announced.h). Each takes its
// turn on the engine by announcing the call there (CollectiveEngine::announce),
// and reaches Gloo only once every rank has announced the same call: Gloo
// pairs calls by issue order alone, reduces whatever it is given (an op or a
// dtype that differs completes, wrong, on every rank) and ends the process on
// a size that differs (gloo::EnforceNotMet on its own thread). Calls reach
// Gloo in issue order, the same on every rank, whatever order their
// announcements complete in. A call already on Gloo fails if the group fails
// at or before its turn; Gloo runs it on, for nobody ("abandoned"). A call
// Gloo refuses at issue (an argument it checks, a collective it lacks) raises
// Gloo's own error, as the program's call would on every rank, and the group
// goes on.
class GlooCalls {
 public:
  // Hands the call to Gloo and returns its future.
  using Start = std::function<c10::intrusive_ptr<c10::ivalue::Future>()>;

  explicit GlooCalls(CollectiveEngine& engine);
  ~GlooCalls();

  // Announces `what` at this call's turn. Throws the group's failure if that
  // turn has failed already.
  c10::intrusive_ptr<c10::ivalue::Future> issue(Start start, const Announced& what);
  // A call issued from a callback takes no turn (callbacks interleave with the
  // program's calls differently on each rank): it reaches Gloo behind every
  // call issued before it, unannounced, as Gloo alone would pair it.
  c10::intrusive_ptr<c10::ivalue::Future> issueUnannounced(Start start);
  // Returns once every call issued before is on Gloo or dropped (its
  // announcement failed), so that a Gloo call issued next is behind them on
  // every rank. Call it after the engine's barrier: their announcements have
  // ended then, and handing over takes no wait.
  void awaitHandedOver();

  uint64_t abandoned() const;
  // How many calls Gloo runs now (abandoned ones too, until Gloo gives up on
  // them); it outlives this object.
  std::shared_ptr<const std::atomic<int>> inGloo() const;

  // After the engine's shutdown: a Gloo call that ends later (an abandoned
  // one, at Gloo's timeout) no longer reaches the engine. Idempotent.
  void shutdown();

 private:
  struct Call;
  struct State;
  c10::intrusive_ptr<c10::ivalue::Future> queue(const std::shared_ptr<Call>& call);
  static void startReady(const std::shared_ptr<State>& state);
  static void start(const std::shared_ptr<State>& state, const std::shared_ptr<Call>& call);

  std::shared_ptr<State> state_;
};

} // namespace fairring
