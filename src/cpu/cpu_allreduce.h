#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cpu/gloo_calls.h"
#include "pipeline/collective_engine.h"
#include "pipeline/ordered_completion.h"

namespace fairring {

// The engine's collectives on CPU tensors as the backend hands them out. The
// program's own run on the main engine and their futures complete in issue
// order through OrderedCompletion. Those issued from inside those futures'
// callbacks (comm hooks such as PowerSGD) run on a second engine, started at
// the first one, and return completed: each stream is issued in an order that
// is the same on every rank, while the two interleave in time differently on
// each (docs/design.md, "Completion order and comm hooks").
class CpuAllreduce {
 public:
  using Post = std::function<c10::intrusive_ptr<c10::ivalue::Future>(CollectiveEngine&)>;
  using Ring = std::function<c10::intrusive_ptr<c10::ivalue::Future>()>;
  // Told of the future of the call's own way (the engine's or the ring's,
  // before the wait for earlier calls that the caller's future adds): the
  // measured choice times a trial call by it.
  using Observe = std::function<void(const c10::intrusive_ptr<c10::ivalue::Future>&)>;

  // `engine` must outlive this object; `callbackOptions` and `store` start the
  // second engine.
  CpuAllreduce(
      int rank,
      CollectiveEngine& engine,
      EngineOptions callbackOptions,
      c10::intrusive_ptr<c10d::Store> store);
  ~CpuAllreduce();

  // Reduces `work` in place (see CollectiveEngine::enqueue) and returns the
  // caller's Work. Throws at once on bad input or a failed group.
  c10::intrusive_ptr<c10d::Work> run(
      at::Tensor work,
      c10d::ReduceOp::RedOpType op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish,
      c10d::OpType opType,
      const char* profilingTitle,
      const std::vector<at::Tensor>& inputs,
      const Ring& ring = nullptr,
      const Observe& observe = nullptr);

  // What run() does, for any operation of the engine: `post` issues it on the
  // engine this call belongs to (main, or callbacks') and returns its future.
  // `ring`, where given, issues the program's own call on the ring delegate
  // instead and returns its future (valued as the caller's outputs); it still
  // takes its turn on the main engine, announcing `ringCall` there, so that a
  // failure fails it as it fails the engine's own calls and ranks that
  // disagree on it fail as they would on the engine. A call from a callback stays on the callback
  // engine: on the delegate it would interleave with the program's calls
  // differently on each rank.
  c10::intrusive_ptr<c10d::Work> runOn(
      const Post& post,
      c10d::OpType opType,
      const char* profilingTitle,
      const std::vector<at::Tensor>& inputs,
      const Ring& ring = nullptr,
      const Announced& ringCall = {},
      const Observe& observe = nullptr);

  // Whether the calling thread issues from a callback of a fairring future
  // (a completion thread's, or a Python callback run inline): such calls run
  // on the callbacks' engine.
  static bool issuedFromCallback();

  // Operations run so far: on the engines, on the ring, and ring calls a
  // failure gave up on while Gloo still ran them; ring calls Gloo runs now.
  struct Stats {
    uint64_t engine{0};
    uint64_t ring{0};
    uint64_t ringAbandoned{0};
    int ringInGloo{0};
  };
  Stats stats() const;
  // How many ring calls Gloo runs now (GlooCalls::inGloo).
  std::shared_ptr<const std::atomic<int>> ringsInGloo() const {
    return rings_.inGloo();
  }

  // The engine's part of barrier(): a barrier operation at its turn, waited
  // for once every earlier operation's future is marked. Throws the group's
  // failure if it failed at or before that turn, on every rank alike.
  void barrier();

  // Stops the callback engine (one still connecting, too) and the completion
  // threads; the caller shuts the main engine down first, which fails what is
  // in flight. Idempotent; waits for nothing a peer must do.
  void shutdown();

 private:
  CollectiveEngine& callbackEngine();
  // From a callback: throws the group's failure if it has failed, failing the
  // callbacks' engine with it (so that its peers hear of it too).
  void refuseIfFailed();
  // Why the program's engine can take no more calls: its group failed, or a
  // peer left (the next call raises that); nullopt while healthy.
  std::optional<std::string> lostPeerOrFailure() const;
  // A program's call after the callbacks' engine failed: refused with its failure.
  void refuseIfCallbacksFailed();

  const int rank_;
  CollectiveEngine& engine_;
  const EngineOptions callbackOptions_;
  c10::intrusive_ptr<c10d::Store> store_;
  OrderedCompletion completion_;
  // Guards the members below. Never held while waiting for anything (a
  // connect, a start): destroy, abort and barrier take it.
  std::mutex mu_;
  std::condition_variable started_;
  std::shared_ptr<CollectiveEngine> callbackEngine_;
  std::shared_ptr<CollectiveEngine> starting_; // the callback engine, while it connects
  std::string startFailure_; // a failed start is not retried
  bool stopped_{false};
  std::atomic<uint64_t> engineOps_{0};
  std::atomic<uint64_t> ringOps_{0};
  GlooCalls rings_;
};

} // namespace fairring
