#pragma once

#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace fairring::plants {

// The bodies of the plants that need more than a skipped line (plants.h), kept
// here so that the code they stand in for holds none of them.

// kDelegatedHoldReleasedAtIssue: what SubgroupAllreduce::orderAfter once did,
// the delegate's Work synchronized at issue with a stream of the group's own
// current, which empties ProcessGroupNCCL's hold on the caller's memory.
void releaseDelegateHoldAtIssue(c10d::Work& work, const c10::Stream& ours);

} // namespace fairring::plants
