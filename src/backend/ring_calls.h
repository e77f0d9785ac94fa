#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "pipeline/collective_engine.h"

namespace fairring {

// The program's allreduces that go to Gloo's ring (one rank per machine,
// FAIRRING_CPU_ALLREDUCE). Each takes its turn on the engine by announcing
// the call there (CollectiveEngine::announce), and reaches Gloo only once every
// rank has announced the same call: Gloo reduces whatever it is given (an op
// or a dtype that differs completes, wrong, on every rank) and ends the
// process on a size that differs (gloo::EnforceNotMet on its own thread).
// Calls reach Gloo in turn order, the same on every rank, whatever order their
// announcements complete in. A call already on Gloo fails if the group fails
// at or before its turn; Gloo runs it on, for nobody ("abandoned").
class RingCalls {
 public:
  using Ring = std::function<c10::intrusive_ptr<c10::ivalue::Future>()>;

  explicit RingCalls(CollectiveEngine& engine);
  ~RingCalls();

  // `ring` hands the call to Gloo and returns its future. Throws the group's
  // failure if the call's turn has failed already.
  c10::intrusive_ptr<c10::ivalue::Future> issue(
      Ring ring,
      int64_t numel,
      at::ScalarType dtype,
      c10d::ReduceOp::RedOpType op);

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
  static void startReady(const std::shared_ptr<State>& state);
  static void start(const std::shared_ptr<State>& state, const std::shared_ptr<Call>& call);

  std::shared_ptr<State> state_;
};

} // namespace fairring
