#include "faults/planted_bugs.h"

#include <c10/core/StreamGuard.h>

namespace fairring::plants {

void releaseDelegateHoldAtIssue(c10d::Work& work, const c10::Stream& ours) {
  c10::StreamGuard onOurs(ours);
  work.synchronize();
}

} // namespace fairring::plants
