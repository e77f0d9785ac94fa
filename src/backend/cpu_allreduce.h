#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pipeline/allreduce_engine.h"
#include "pipeline/ordered_completion.h"

namespace fairring {

// Allreduce of CPU tensors as the backend hands it out. The program's own
// allreduces run on the main engine and their futures complete in issue
// order through OrderedCompletion. Allreduces issued from inside those
// futures' callbacks (comm hooks such as PowerSGD) run on a second engine,
// started at the first one, and return completed: each stream is issued in
// an order that is the same on every rank, while the two interleave in time
// differently on each (docs/design.md, "Completion order and comm hooks").
class CpuAllreduce {
 public:
  using Post = std::function<c10::intrusive_ptr<c10::ivalue::Future>(AllreduceEngine&)>;
  using Ring = std::function<c10::intrusive_ptr<c10::ivalue::Future>()>;

  // `engine` must outlive this object; `callbackOptions` and `store` start the
  // second engine.
  CpuAllreduce(
      int rank,
      AllreduceEngine& engine,
      EngineOptions callbackOptions,
      c10::intrusive_ptr<c10d::Store> store);
  ~CpuAllreduce();

  // Reduces `work` in place (see AllreduceEngine::enqueue) and returns the
  // caller's Work. Throws at once on bad input or a failed group.
  c10::intrusive_ptr<c10d::Work> run(
      at::Tensor work,
      c10d::ReduceOp::RedOpType op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish,
      c10d::OpType opType,
      const char* profilingTitle,
      const std::vector<at::Tensor>& inputs,
      const Ring& ring = nullptr);

  // What run() does, for any operation of the engine: `post` issues it on the
  // engine this call belongs to (main, or callbacks') and returns its future.
  // `ring`, where given, issues the program's own call on the delegate's ring
  // instead and returns its future (valued as the caller's outputs); a call
  // from a callback stays on the callback engine, since on the delegate it
  // would interleave with the program's calls differently on each rank.
  c10::intrusive_ptr<c10d::Work> runOn(
      const Post& post,
      c10d::OpType opType,
      const char* profilingTitle,
      const std::vector<at::Tensor>& inputs,
      const Ring& ring = nullptr);

  // Operations run so far: on the engines, and on the delegate's ring.
  struct Stats {
    uint64_t engine{0};
    uint64_t ring{0};
  };
  Stats stats() const;

  // Blocks until every operation issued so far on the main engine is done
  // and its future marked (the callback engine's return done); throws the
  // group's failure if one of them failed. What barrier() waits for before it
  // synchronises the ranks, as Gloo's barrier waits for earlier work.
  void awaitIssued();

  // Stops the callback engine and the completion threads; the caller shuts
  // the main engine down first, which fails what is in flight. Idempotent.
  void shutdown();

 private:
  AllreduceEngine& callbackEngine();

  const int rank_;
  AllreduceEngine& engine_;
  const EngineOptions callbackOptions_;
  c10::intrusive_ptr<c10d::Store> store_;
  OrderedCompletion completion_;
  std::mutex mu_; // guards the three below; held while the callback engine connects
  std::unique_ptr<AllreduceEngine> callbackEngine_;
  // The future of the last operation issued on the main engine: futures are
  // marked in issue order, so once it is, all are.
  c10::intrusive_ptr<c10::ivalue::Future> lastIssued_;
  std::atomic<uint64_t> engineOps_{0};
  std::atomic<uint64_t> ringOps_{0};
  std::string startFailure_; // a failed start is not retried
  bool stopped_{false};
};

} // namespace fairring
