#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <functional>
#include <optional>
#include <vector>

#include "pipeline/announced.h"

namespace fairring {

class MeasuredChoice;

// What runs the collectives on one kind of device's tensors, chosen once per
// device when the group is made (FairringBackend): fairring's CPU engine
// (cpu_path.h), the composition of sub-group collectives (composed_path.h), or
// the device's delegate alone (delegate_path.h). The backend asks the path of
// the tensors' device and never branches per collective.
//
// The collectives fairring may run itself have a method each; by default they
// too go to the delegate. Every other collective is `delegated`: handed to the
// device's delegate (NCCL, Gloo), ordered as the path needs it to be.
class DevicePath {
 public:
  using Issue = std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&)>;
  // Who makes a delegated call: every rank of the group (a collective), or
  // some (send, recv: the ranks of a pair). Nothing some ranks do may change
  // what a later collective of all ranks does.
  enum class Callers : uint8_t { kEveryRank, kSomeRanks };

  virtual ~DevicePath() = default;

  // A collective on `tensors` (all it reads and writes) that the delegate
  // runs: `issue` calls it on the delegate and returns its Work (null where
  // the delegate returns none). `issue` owns what it passes: a path may call
  // it later, on another thread (the CPU path, once `what` is announced
  // alike by every rank: gloo_calls.h). Without `what`, nothing is checked
  // across ranks.
  virtual c10::intrusive_ptr<c10d::Work> delegated(
      const std::vector<at::Tensor>& tensors,
      const Issue& issue,
      Callers callers,
      const std::optional<Announced>& what) = 0;

  virtual c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);
  virtual c10::intrusive_ptr<c10d::Work> allreduceCoalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts);
  virtual c10::intrusive_ptr<c10d::Work> reduceScatterBase(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts);
  virtual c10::intrusive_ptr<c10d::Work> reduceScatterList(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts);
  virtual c10::intrusive_ptr<c10d::Work> reduceScatterCoalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts);
  virtual c10::intrusive_ptr<c10d::Work> allGatherBase(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts);
  virtual c10::intrusive_ptr<c10d::Work> allGatherList(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts);
  virtual c10::intrusive_ptr<c10d::Work> allGatherCoalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts);

  // barrier(): returns once what the path ran, issued before it, is done on
  // the device (raising the path's failure, on every rank alike).
  virtual void awaitIssued(const c10d::BarrierOptions& opts) {}
  // Stops what the path runs itself (not the delegate, which the backend
  // owns): `drain` lets what is in flight finish first (destroy), else it is
  // aborted. Idempotent; never throws.
  virtual void stop(bool drain) {}
  // The measured choice of this device's allreduces (FAIRRING_*_ALLREDUCE=auto),
  // where the path has one.
  virtual const MeasuredChoice* measured() const {
    return nullptr;
  }
};

// What barrier() owes the collectives a path handed to its delegate: past
// ProcessGroupNCCL's barrier (an allreduce queued after them on the
// communicator, waited for on the host) they are done on the device, so a
// path that used its delegate since the last barrier runs the delegate's
// barrier too. Whether it did is the program's doing, the same on every rank:
// only collectives every rank makes count (a send of ranks 0 and 1 would put
// them in the delegate's barrier and the others not: a hang). NCCL's barrier
// does not order point-to-point calls either (they run on streams and
// communicators of their own).
class DelegateBarrier {
 public:
  void used(DevicePath::Callers callers);
  void await(const c10::intrusive_ptr<c10d::Backend>& delegate, const c10d::BarrierOptions& opts);

 private:
  std::atomic<bool> used_{false};
};

// Every tensor of a collective's arguments, in order (tensors, lists of them,
// lists of lists).
inline void collectTensors(std::vector<at::Tensor>& all, const at::Tensor& t) {
  all.push_back(t);
}
inline void collectTensors(std::vector<at::Tensor>& all, const std::vector<at::Tensor>& ts) {
  all.insert(all.end(), ts.begin(), ts.end());
}
inline void collectTensors(std::vector<at::Tensor>& all, const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& list : lists) {
    collectTensors(all, list);
  }
}
template <typename... Sets>
std::vector<at::Tensor> tensorsOf(const Sets&... sets) {
  std::vector<at::Tensor> all;
  (collectTensors(all, sets), ...);
  return all;
}

} // namespace fairring
