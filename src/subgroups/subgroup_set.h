#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fairring {

// The process groups the allreduce is composed of, made in Python from the
// store (fairring_pg/cuda/subgroups.py): ProcessGroupNCCL for CUDA tensors, and
// ProcessGroupGloo for the CPU test path that runs this same code in CI.
struct Subgroups {
  // Every rank of the job: the tails of pieces (and the delegate's own
  // allreduce, which the backend calls itself).
  c10::intrusive_ptr<c10d::Backend> world;
  // This machine's ranks (several local ranks only). Two groups, so that the
  // reduce-scatter of one piece and the all-gather of another run at once:
  // one communicator runs its operations one after the other.
  c10::intrusive_ptr<c10d::Backend> localReduce;
  c10::intrusive_ptr<c10d::Backend> localGather;
  // This rank's rail (same local rank on every machine), one per lane:
  // K communicators put K pieces on the wire at once. Made only where the
  // plan composes some call, and then the local groups too.
  std::vector<c10::intrusive_ptr<c10d::Backend>> lanes;
};

// How the sub-groups ended, for a destroy to report (SubgroupStats).
struct SubgroupsClosed {
  std::string shutdown{"running"}; // how destroy or abort ended
  int abortedGroups{0};
  int timeoutAborts{0}; // sub-groups aborted because a wait of a composed call timed out
};

// The sub-groups and their closing: shut down gracefully or aborted, by the
// one caller that closes the path (SubgroupAllreduce's kClosed), and aborted
// once more by whichever Work's wait times out first. Its own lock, apart
// from the allreduce's, which an allreduce holds while it issues: an abort
// never waits for one. Closing waits (NCCL's graceful shutdown waits for its
// collectives) and holds no lock meanwhile.
class SubgroupSet {
 public:
  using Group = c10::intrusive_ptr<c10d::Backend>;

  explicit SubgroupSet(Subgroups groups);

  const Subgroups& groups() const {
    return groups_;
  }
  // The composition's sub-groups; `withWorld`: the world group too (the
  // backend's delegate, which the backend shuts down itself after a graceful end).
  std::vector<Group> list(bool withWorld) const;
  // Whether any of them (the world group included) reports an error.
  bool anyFailed() const;
  // Shuts the sub-groups down (`graceful`) or aborts them, and records
  // `outcome`. The caller calls it once.
  void close(bool graceful, bool withWorld, const std::string& outcome, int rank);
  // What a Work's timed-out wait calls: aborts the composition's sub-groups
  // (not the world group: its own Works abort it), once. Holds no `this`: a
  // Work may outlive the path.
  const std::function<void()>& abortOnTimeout() const {
    return abortOnTimeout_;
  }
  SubgroupsClosed closed() const;

 private:
  const Subgroups groups_;
  const std::shared_ptr<std::atomic<int>> timeoutAborts_{std::make_shared<std::atomic<int>>(0)};
  const std::function<void()> abortOnTimeout_; // made once: every Work holds a copy
  mutable std::mutex mu_;
  std::string outcome_{"running"};
  int abortedGroups_{0};
};

} // namespace fairring
