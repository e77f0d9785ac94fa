// Creating and connecting every sub-group before the first allreduce uses any.
#include "subgroups/subgroup_allreduce.h"

#include <c10/util/Exception.h>

namespace fairring {

void SubgroupAllreduce::connect(LaneStreams& streams) {
  // NCCL creates a communicator, and connects its peers, at its first
  // collective; creating one can synchronise the device. So every group gets
  // a small collective of each kind the allreduce issues on it, in the same
  // order on every rank (world, local, lanes), and the host waits for all of
  // them before the first unit: nothing of ours is in flight yet. The values
  // say whether each group holds the ranks it was built from.
  const int L = options_.localSize;
  const int M = options_.numMachines;
  const int l = options_.localRank;
  const int m = options_.machine;
  const c10::Device device = streams.device();
  auto ints = [&](std::vector<int> values) {
    return at::tensor(values, at::TensorOptions().dtype(at::kInt)).to(device);
  };
  auto range = [](int n, const std::function<int(int)>& f) {
    std::vector<int> v;
    for (int i = 0; i < n; ++i) {
      v.push_back(f(i));
    }
    return v;
  };
  struct Check {
    std::string group;
    at::Tensor got;
    std::vector<int> want;
  };
  std::vector<Check> checks;
  streams.beginOp();
  auto onStream = streams.enter(0);
  {
    std::vector<at::Tensor> t{ints({options_.rank + 1})};
    groups_.world->allreduce(t, c10d::AllreduceOptions())->wait();
    checks.push_back({"the world group", t[0], {options_.worldSize * (options_.worldSize + 1) / 2}});
  }
  if (groups_.localReduce) {
    at::Tensor in = ints(range(L, [&](int j) { return 1000 * (l + 1) + j; }));
    at::Tensor out = ints({0});
    groups_.localReduce->_reduce_scatter_base(out, in, c10d::ReduceScatterOptions())->wait();
    checks.push_back({"the machine's reduce-scatter group", out, {1000 * L * (L + 1) / 2 + L * l}});
    at::Tensor gathered = ints(range(L, [](int) { return -1; }));
    at::Tensor mine = ints({l});
    groups_.localGather->_allgather_base(gathered, mine, c10d::AllgatherOptions())->wait();
    checks.push_back({"the machine's all-gather group", gathered, range(L, [](int j) { return j; })});
  }
  for (size_t k = 0; k < groups_.lanes.size(); ++k) {
    const auto& rail = groups_.lanes[k];
    const std::string name = "lane " + std::to_string(k) + " of the rail";
    at::Tensor in = ints(range(M, [&](int j) { return M * m + j; }));
    at::Tensor out = ints(range(M, [](int) { return -1; }));
    std::vector<int64_t> even;
    rail->alltoall_base(out, in, even, even, c10d::AllToAllOptions())->wait();
    checks.push_back({name + " (all-to-all)", out, range(M, [&](int j) { return M * j + m; })});
    at::Tensor gathered = ints(range(M, [](int) { return -1; }));
    at::Tensor mine = ints({m});
    rail->_allgather_base(gathered, mine, c10d::AllgatherOptions())->wait();
    checks.push_back({name + " (all-gather)", gathered, range(M, [](int j) { return j; })});
    at::Tensor spread = ints(range(M, [&](int j) { return 100 * (m + 1) + j; }));
    at::Tensor summed = ints({0});
    rail->_reduce_scatter_base(summed, spread, c10d::ReduceScatterOptions())->wait();
    checks.push_back({name + " (reduce-scatter)", summed, {100 * M * (M + 1) / 2 + M * m}});
  }
  if (auto reached = streams.mark(0)) {
    const Status status = waitOnHost(
        *reached, std::chrono::steady_clock::now() + options_.timeout,
        [this] { return closed(); });
    TORCH_CHECK(status.ok(), "fairring: connecting the sub-groups of rank ", options_.rank, " on ", device,
                " did not finish within ", options_.timeout.count(), " ms: ", status.message());
  }
  for (const Check& check : checks) {
    const at::Tensor got = check.got.cpu();
    const std::vector<int> values(got.data_ptr<int>(), got.data_ptr<int>() + got.numel());
    TORCH_CHECK(values == check.want, "fairring: ", check.group, " of rank ", options_.rank, " (machine ", m,
                ", local rank ", l, ") gave ", c10::ArrayRef<int>(values), " where its members would give ",
                c10::ArrayRef<int>(check.want), ": the group does not hold the ranks it was built from");
  }
}

} // namespace fairring
