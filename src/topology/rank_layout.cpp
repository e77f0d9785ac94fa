#include "topology/rank_layout.h"

#include <algorithm>
#include <string>
#include <stdexcept>

namespace fairring {

RankLayout::RankLayout(
    int rank,
    std::vector<int> machineOf,
    std::vector<int> localRankOf,
    std::vector<std::string> hostnames)
    : rank_(rank),
      machineOf_(std::move(machineOf)),
      hostnames_(std::move(hostnames)),
      localRankOf_(std::move(localRankOf)) {
  const int worldSize = static_cast<int>(machineOf_.size());
  if (rank_ < 0 || rank_ >= worldSize) {
    throw std::invalid_argument(
        "fairring: rank " + std::to_string(rank_) + " is outside a machine table of " +
        std::to_string(worldSize) + " ranks");
  }
  if (static_cast<int>(hostnames_.size()) != worldSize || static_cast<int>(localRankOf_.size()) != worldSize) {
    throw std::invalid_argument("fairring: hostnames, machine_of and local_rank_of differ in length");
  }
  numMachines_ = 1 + *std::max_element(machineOf_.begin(), machineOf_.end());
  localSize_ = 1 + *std::max_element(localRankOf_.begin(), localRankOf_.end());
  if (numMachines_ * localSize_ != worldSize) {
    throw std::invalid_argument(
        "fairring: " + std::to_string(worldSize) + " ranks are not " + std::to_string(numMachines_) +
        " machines of " + std::to_string(localSize_) + " ranks");
  }
  ranksByMachine_.assign(numMachines_, std::vector<int>(localSize_, -1));
  for (int r = 0; r < worldSize; ++r) {
    const int m = machineOf_[r];
    const int l = localRankOf_[r];
    if (m < 0 || l < 0 || ranksByMachine_[m][l] != -1) {
      throw std::invalid_argument(
          "fairring: rank " + std::to_string(r) + " has machine " + std::to_string(m) + " and local rank " +
          std::to_string(l) + ": negative, or taken by another rank");
    }
    ranksByMachine_[m][l] = r;
  }
  machine_ = machineOf_[rank_];
  localRank_ = localRankOf_[rank_];
}

int RankLayout::rankOf(int machine, int localRank) const {
  return ranksByMachine_[machine][localRank];
}

std::vector<int> RankLayout::peers() const {
  std::vector<int> out;
  for (int l = 0; l < localSize_; ++l) {
    if (l != localRank_) {
      out.push_back(rankOf(machine_, l));
    }
  }
  for (int m = 0; m < numMachines_; ++m) {
    if (m != machine_) {
      out.push_back(rankOf(m, localRank_));
    }
  }
  return out;
}

std::string RankLayout::describe(int rank) const {
  if (rank < 0 || rank >= worldSize()) {
    return "rank " + std::to_string(rank);
  }
  return "rank " + std::to_string(rank) + " (host " + hostnames_[rank] + ")";
}

} // namespace fairring
