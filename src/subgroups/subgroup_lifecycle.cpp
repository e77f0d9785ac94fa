// The sub-group path's life after its calls: barrier's wait, destroy's drain,
// abort, and closing the sub-groups once. Failures are GroupFailure's: a wait
// that cannot end (a sub-group's error, the group's timeout) fails the group
// from turn 0, as an operation past the group's timeout does on the CPU engine.
#include "subgroups/subgroup_allreduce.h"

#include <c10/util/Exception.h>

#include "faults/plants.h"

namespace fairring {

DrainEnd SubgroupAllreduce::drain(const std::vector<Done>& pending) {
  std::vector<std::function<bool()>> checks;
  for (const auto& done : pending) {
    checks.emplace_back([done] { return done->reached(); });
  }
  return drainUntil(
      checks, [this] { return closed() || set_.anyFailed(); }, std::chrono::steady_clock::now() + options_.timeout);
}

std::string SubgroupAllreduce::whyNotDrained(DrainEnd end, const std::string& subgroupError) const {
  return end == DrainEnd::kFailed
      ? subgroupError
      : "its allreduces did not finish within " + std::to_string(options_.timeout.count()) + " ms";
}

void SubgroupAllreduce::awaitIssued() {
  if (plants::planted(plants::Plant::kBarrierNotWaiting)) {
    return;
  }
  std::vector<Done> pending;
  {
    std::unique_lock<std::mutex> lock(mu_);
    pending = ledger_.inFlight(Held(lock)).all();
  }
  if (failure_->failed()) {
    throw c10::DistBackendError(failure_->refusal());
  }
  const DrainEnd end = drain(pending);
  if (end == DrainEnd::kDrained) {
    return;
  }
  const std::string why = "fairring: barrier on rank " + std::to_string(options_.rank) + ": " +
      whyNotDrained(end, "a sub-group reported an error (or the group was aborted) while its allreduces were finishing");
  failure_->fail(why, 0);
  throw c10::DistBackendError(why);
}

void SubgroupAllreduce::shutdown() {
  std::vector<Done> pending;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Compared and set: an abort() (which takes no lock) may close meanwhile,
    // and kClosed is never left.
    Life now = life_.load();
    do {
      if (now >= Life::kStopped) {
        return;
      }
    } while (!life_.compare_exchange_weak(now, Life::kStopped));
    pending = ledger_.inFlight(Held(lock)).all();
  }
  connected_.notify_all();
  // Waited for with no lock held: an abort() from another thread is not kept
  // out, and stops the wait.
  std::string failedEarlier = failure_->reason();
  DrainEnd end = DrainEnd::kFailed;
  if (failedEarlier.empty()) {
    try {
      end = drain(pending);
    } catch (const std::exception& e) {
      failedEarlier = e.what(); // the device could not say: as good as failed
    }
  }
  if (end == DrainEnd::kDrained) {
    close(/*graceful=*/true, /*withWorld=*/false, "drained");
    return;
  }
  const std::string why = !failedEarlier.empty()
      ? "the group had failed (" + failedEarlier + ")"
      : whyNotDrained(end, "a sub-group reported an error while its allreduces were finishing");
  TORCH_WARN("fairring: destroying rank ", options_.rank, "'s process group: ", why,
             "; its sub-groups, the world group included, were aborted rather than waited for");
  close(/*graceful=*/false, /*withWorld=*/true, std::string("aborted: ") + drainEndName(end));
}

void SubgroupAllreduce::abort() {
  // Takes no lock that an allreduce holds while it issues (on the CPU test
  // path a Gloo collective blocks there), so an abort is never kept waiting.
  close(/*graceful=*/false, /*withWorld=*/false, "aborted");
  connected_.notify_all();
}

void SubgroupAllreduce::close(bool graceful, bool withWorld, const std::string& outcome) {
  // The one transition into kClosed: whoever makes it closes the groups.
  if (life_.exchange(Life::kClosed) == Life::kClosed) {
    return;
  }
  set_.close(graceful, withWorld, outcome, options_.rank);
}

} // namespace fairring
