#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace fairring {

// What an allreduce of a given size does, from the plan Python made once per
// group from the cost model (fairring_pg.model.cuda_plan): NCCL's own
// allreduce on the world group, or the composition, cut into at least
// `pieces` pieces, with that rail exchange.
enum class PlanPath : uint8_t { kNccl, kCompose };
enum class RailExchange : uint8_t {
  kAllToAll, // two all-to-all hops around one reduction kernel (staging: a chunk and a shard)
  kReduceScatter, // NCCL's reduce-scatter and all-gather on the rail, in place (no staging)
};

struct PlanRow {
  size_t fromBytes{0}; // rows sorted ascending, the first from 0
  PlanPath path{PlanPath::kNccl};
  int pieces{1}; // kCompose: at least this many
  RailExchange exchange{RailExchange::kAllToAll}; // kCompose only
  // kCompose: a size class of the measured choice (FAIRRING_CUDA_ALLREDUCE=auto),
  // whose calls compose as this row says or are the delegate's own, as its
  // trials find faster (src/measured/).
  bool measured{false};
};

// Every piece, chunk and shard of a composed call starts a multiple of this
// many bytes after the start of the tensor: NCCL's kernels take their fast
// path on 16-byte aligned buffers (the caching allocator aligns a tensor's
// start far more).
constexpr size_t kPieceAlignment = 16;

// The elements of one group: L*M times the elements that make kPieceAlignment
// bytes (at least one), so that a whole number of groups splits into L chunks
// of M shards, each a multiple of kPieceAlignment bytes.
inline int64_t groupElements(size_t elemSize, int localSize, int numMachines) {
  const int64_t aligned = std::max<int64_t>(1, static_cast<int64_t>(kPieceAlignment / std::max<size_t>(1, elemSize)));
  return aligned * localSize * numMachines;
}

// One range of the flattened tensor: a piece of the composition (a whole
// number of groups, groupElements(), so that it splits into L chunks of M
// shards and is reduce-scattered and gathered in place) or one NCCL allreduce
// on the world group ("direct": the tail of a composed call).
struct Unit {
  int64_t begin{0};
  int64_t size{0};
  bool direct{false};
};

struct CallCut {
  size_t row{0}; // which row of the plan the call took
  size_t bytes{0}; // the call's, in the dtype it is reduced in
  std::vector<Unit> units; // pieces in order, then the direct tail; or one direct unit
  RailExchange exchange{RailExchange::kAllToAll};
};

// How an allreduce of `numel` elements of `elemSize` bytes (the dtype it is
// reduced in) is cut. It reads only the call's size and what every rank was
// given alike, so every rank issues the same collectives:
//   the row: the last whose fromBytes <= numel * elemSize;
//   nothing for an empty tensor or a world of one;
//   one direct unit where the row is NCCL's, on one machine, or for fewer
//   elements than a group (groupElements());
//   else the call's whole groups in P = min(groups, max(pieces, ceil(groups /
//   groups that fit in largestPieceBytes))) pieces, as even as can be (the
//   first groups % P one group longer), and the fewer than a group's elements
//   left over as one direct unit.
// fairring_pg.model.composition.cut_pieces is the same rule (a test compares).
inline CallCut cutCall(
    int64_t numel,
    size_t elemSize,
    const std::vector<PlanRow>& rows,
    size_t largestPieceBytes,
    int localSize,
    int numMachines) {
  CallCut cut;
  const size_t bytes = static_cast<size_t>(numel) * elemSize;
  cut.bytes = bytes;
  for (size_t i = 1; i < rows.size() && rows[i].fromBytes <= bytes; ++i) {
    cut.row = i;
  }
  if (numel == 0 || localSize * numMachines == 1) {
    return cut;
  }
  const int64_t unit = groupElements(elemSize, localSize, numMachines);
  const PlanRow* row = rows.empty() ? nullptr : &rows[cut.row];
  if (row == nullptr || row->path == PlanPath::kNccl || numMachines == 1 || numel < unit) {
    cut.units.push_back(Unit{0, numel, true});
    return cut;
  }
  cut.exchange = row->exchange;
  const int64_t groups = numel / unit;
  const int64_t tail = numel % unit;
  const int64_t fit = largestPieceBytes > 0
      ? std::max<int64_t>(1, static_cast<int64_t>(largestPieceBytes / (elemSize * static_cast<size_t>(unit))))
      : groups;
  const int64_t count = std::min(groups, std::max<int64_t>(row->pieces, (groups + fit - 1) / fit));
  const int64_t base = groups / count;
  const int64_t longer = groups % count;
  int64_t begin = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t size = (base + (i < longer ? 1 : 0)) * unit;
    cut.units.push_back(Unit{begin, size, false});
    begin += size;
  }
  if (tail > 0) {
    cut.units.push_back(Unit{groups * unit, tail, true});
  }
  return cut;
}

// The plan's rows from Python's (from_bytes, "nccl" | "compose" | "measure",
// pieces, "alltoall" | "reduce_scatter"); anything else is refused, naming it.
// "measure" is a composing row whose calls the measured choice may give to the
// delegate instead.
std::vector<PlanRow> planRows(const std::vector<std::tuple<size_t, std::string, int, std::string>>& rows);

} // namespace fairring
