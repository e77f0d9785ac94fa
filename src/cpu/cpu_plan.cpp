#include "cpu/cpu_plan.h"

#include <c10/util/Exception.h>

namespace fairring {

std::vector<CpuPlanRow> cpuPlanRows(const std::vector<std::tuple<size_t, std::string>>& rows) {
  std::vector<CpuPlanRow> out;
  for (const auto& [from, way] : rows) {
    CpuPlanRow row{from, CpuWay::kEngine};
    if (way == "ring") {
      row.way = CpuWay::kRing;
    } else if (way == "measure") {
      row.way = CpuWay::kMeasured;
    } else {
      TORCH_CHECK(way == "engine", "fairring: a CPU plan row says '", way, "'; expected engine, ring or measure");
    }
    TORCH_CHECK(
        out.empty() ? from == 0 : from > out.back().fromBytes,
        "fairring: the CPU plan's rows must start at 0 and grow; row ", out.size(), " starts at ", from);
    out.push_back(row);
  }
  if (out.empty()) {
    out.push_back(CpuPlanRow{});
  }
  return out;
}

} // namespace fairring
