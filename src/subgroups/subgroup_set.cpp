#include "subgroups/subgroup_set.h"

#include <c10/util/Exception.h>

namespace fairring {

namespace {

std::function<void()> abortingOnce(std::vector<SubgroupSet::Group> groups, std::shared_ptr<std::atomic<int>> aborted) {
  return [groups = std::move(groups), aborted = std::move(aborted)]() {
    if (aborted->exchange(static_cast<int>(groups.size())) != 0) {
      return; // once
    }
    for (const auto& group : groups) {
      try {
        group->abort();
      } catch (const std::exception& e) {
        TORCH_WARN("fairring: aborting a sub-group after a wait's timeout failed: ", e.what());
      }
    }
  };
}

} // namespace

SubgroupSet::SubgroupSet(Subgroups groups)
    : groups_(std::move(groups)), abortOnTimeout_(abortingOnce(list(/*withWorld=*/false), timeoutAborts_)) {}

std::vector<SubgroupSet::Group> SubgroupSet::list(bool withWorld) const {
  std::vector<Group> groups(groups_.lanes.begin(), groups_.lanes.end());
  for (const auto& group : {groups_.localReduce, groups_.localGather}) {
    if (group) {
      groups.push_back(group);
    }
  }
  if (withWorld) {
    groups.push_back(groups_.world);
  }
  return groups;
}

bool SubgroupSet::anyFailed() const {
  for (const auto& group : list(/*withWorld=*/true)) {
    try {
      if (group->getError() != c10d::ErrorType::SUCCESS) {
        return true;
      }
    } catch (const std::exception&) {
      // A backend that cannot report errors (torch 2.13's Gloo throws "does
      // not support getError") is not known to have failed: a drain still
      // ends at the timeout if its work never finishes.
    }
  }
  return false;
}

void SubgroupSet::close(bool graceful, bool withWorld, const std::string& outcome, int rank) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    outcome_ = outcome;
  }
  int aborted = 0;
  for (const auto& group : list(withWorld)) {
    try {
      if (graceful) {
        group->shutdown();
      } else {
        group->abort();
        ++aborted;
      }
    } catch (const std::exception& e) {
      TORCH_WARN("fairring: ", graceful ? "shutting down" : "aborting", " a sub-group on rank ", rank,
                 " failed: ", e.what());
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  abortedGroups_ = aborted;
}

SubgroupsClosed SubgroupSet::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return SubgroupsClosed{outcome_, abortedGroups_, timeoutAborts_->load()};
}

} // namespace fairring
