#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace fairring {

// What a CPU allreduce of a given size runs, from the plan Python made once per
// group (fairring_pg.model.cpu_plan, FAIRRING_CPU_ALLREDUCE): fairring's
// engine, Gloo's ring, or whichever the measured choice (src/measured/) finds
// faster on this cluster. Rows sorted ascending, the first from 0; a call of
// b bytes takes the last row with fromBytes <= b.
enum class CpuWay : uint8_t { kEngine, kRing, kMeasured };

struct CpuPlanRow {
  size_t fromBytes{0};
  CpuWay way{CpuWay::kEngine};
};

// The row of a call of `bytes` bytes (rows as above; 0 where there are none).
inline size_t cpuRowOf(const std::vector<CpuPlanRow>& rows, size_t bytes) {
  size_t row = 0;
  for (size_t i = 1; i < rows.size() && rows[i].fromBytes <= bytes; ++i) {
    row = i;
  }
  return row;
}

// The rows from Python's (from_bytes, "engine" | "ring" | "measure"); anything
// else, or rows not starting at 0 and growing, is refused, naming it.
std::vector<CpuPlanRow> cpuPlanRows(const std::vector<std::tuple<size_t, std::string>>& rows);

} // namespace fairring
