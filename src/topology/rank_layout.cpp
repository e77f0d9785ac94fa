#include "topology/rank_layout.h"

#include <algorithm>
#include <string>
#include <stdexcept>

namespace fairring {

RankLayout::RankLayout(int rank, std::vector<int> machineOf, std::vector<std::string> hostnames)
    : rank_(rank), machineOf_(std::move(machineOf)), hostnames_(std::move(hostnames)) {
  const int worldSize = static_cast<int>(machineOf_.size());
  if (rank_ < 0 || rank_ >= worldSize) {
    throw std::invalid_argument(
        "fairring: rank " + std::to_string(rank_) + " is outside a machine table of " +
        std::to_string(worldSize) + " ranks");
  }
  if (static_cast<int>(hostnames_.size()) != worldSize) {
    throw std::invalid_argument("fairring: hostnames and machine_of differ in length");
  }
  numMachines_ = 1 + *std::max_element(machineOf_.begin(), machineOf_.end());
  ranksByMachine_.resize(numMachines_);
  for (int r = 0; r < worldSize; ++r) {
    const int m = machineOf_[r];
    if (m < 0) {
      throw std::invalid_argument("fairring: negative machine index for rank " + std::to_string(r));
    }
    ranksByMachine_[m].push_back(r);
  }
  localSize_ = static_cast<int>(ranksByMachine_[0].size());
  for (int m = 0; m < numMachines_; ++m) {
    if (static_cast<int>(ranksByMachine_[m].size()) != localSize_) {
      throw std::invalid_argument(
          "fairring: machine " + std::to_string(m) + " has " +
          std::to_string(ranksByMachine_[m].size()) + " ranks but machine 0 has " +
          std::to_string(localSize_) + "; every machine needs the same number of ranks");
    }
  }
  localRankOf_.assign(worldSize, 0);
  for (const auto& ranks : ranksByMachine_) {
    for (size_t l = 0; l < ranks.size(); ++l) {
      localRankOf_[ranks[l]] = static_cast<int>(l);
    }
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
