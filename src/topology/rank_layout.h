#pragma once

#include <string>
#include <vector>

namespace fairring {

// Who is where: M machines of L ranks each. Rank (machine m, local rank l)
// talks across machines only to the ranks of its own rail l, and inside its
// machine to the other local ranks.
class RankLayout {
 public:
  // machineOf[r] and localRankOf[r] are rank r's machine (0..M-1) and local
  // rank (0..L-1), as fairring_pg.topology decided them (it falls back to one
  // rank per machine when the deployment is irregular); every (machine, local
  // rank) must be taken by exactly one rank, which is checked.
  RankLayout(
      int rank,
      std::vector<int> machineOf,
      std::vector<int> localRankOf,
      std::vector<std::string> hostnames);

  int rank() const { return rank_; }
  int worldSize() const { return static_cast<int>(machineOf_.size()); }
  int numMachines() const { return numMachines_; }
  int localSize() const { return localSize_; }
  int machine() const { return machine_; }
  int localRank() const { return localRank_; }

  // The global rank of (machine, localRank), and back.
  int rankOf(int machine, int localRank) const;
  int machineOf(int rank) const { return machineOf_[rank]; }
  int localRankOf(int rank) const { return localRankOf_[rank]; }

  // Local peers (same machine, other local ranks) then rail peers (same local
  // rank, other machines): the only ranks this rank ever exchanges data with.
  std::vector<int> peers() const;

  // "rank 3 (host node1)": what every error message names a peer with.
  std::string describe(int rank) const;

 private:
  int rank_;
  std::vector<int> machineOf_;
  std::vector<std::string> hostnames_;
  int numMachines_{0};
  int localSize_{0};
  int machine_{0};
  int localRank_{0};
  std::vector<std::vector<int>> ranksByMachine_;
  std::vector<int> localRankOf_;
};

} // namespace fairring
