#include "subgroups/call_ledger.h"

#include <algorithm>

namespace fairring {

CallLedger::CallLedger(size_t planRows, int numLanes) : planRows_(planRows), numLanes_(std::max(1, numLanes)) {}

void CallLedger::countRow(size_t row) {
  ++counts_.operations;
  counts_.rows.resize(std::max<size_t>({counts_.rows.size(), planRows_, row + 1}), 0);
  ++counts_.rows[row];
}

void CallLedger::countDelegated(const Held&, size_t row) {
  countRow(row);
  ++counts_.ncclCalls;
}

void CallLedger::countCall(const Held&, const CallCut& cut, size_t orderingWaits) {
  countRow(cut.row);
  counts_.orderingWaits += orderingWaits;
  if (cut.units.front().direct) {
    ++counts_.ncclCalls; // the plant kDirectThroughOurStreams
  } else {
    ++counts_.composedCalls;
  }
}

void CallLedger::countUnits(const Held&, uint64_t direct, uint64_t sliced) {
  counts_.directUnits += direct;
  counts_.slicedUnits += sliced;
}

} // namespace fairring
