#include "subgroups/call_cut.h"

#include <c10/util/Exception.h>

namespace fairring {

std::vector<PlanRow> planRows(const std::vector<std::tuple<size_t, std::string, int, std::string>>& rows) {
  std::vector<PlanRow> plan;
  for (const auto& [fromBytes, path, pieces, exchange] : rows) {
    PlanRow row;
    row.fromBytes = fromBytes;
    TORCH_CHECK(path == "nccl" || path == "compose" || path == "measure",
                "fairring: a plan row's path is 'nccl', 'compose' or 'measure', not '", path, "'");
    row.path = path == "nccl" ? PlanPath::kNccl : PlanPath::kCompose;
    row.measured = path == "measure";
    if (row.path == PlanPath::kCompose) {
      TORCH_CHECK(pieces >= 1, "fairring: a composing plan row needs at least one piece, not ", pieces);
      TORCH_CHECK(exchange == "alltoall" || exchange == "reduce_scatter",
                  "fairring: a plan row's rail exchange is 'alltoall' or 'reduce_scatter', not '", exchange, "'");
      row.pieces = pieces;
      row.exchange = exchange == "alltoall" ? RailExchange::kAllToAll : RailExchange::kReduceScatter;
    }
    plan.push_back(row);
  }
  return plan;
}

} // namespace fairring
