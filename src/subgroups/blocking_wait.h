#pragma once

#include <functional>
#include <string>

#include "common/status.h"

namespace fairring {

// Whether a composed call's wait() blocks the host, read as ProcessGroupNCCL
// reads it (torch 2.13: Utils.hpp l.151-189, getCvarBool, over
// ProcessGroupNCCL.hpp l.60-62, TORCH_NCCL_BLOCKING_WAIT then its old name
// NCCL_BLOCKING_WAIT, read last to first): the first name set wins; y, yes,
// t, true and 1 are true, n, no, f, false and 0 false, in any case; any other
// value of either is an error (ProcessGroupNCCL's constructor raises), here
// naming the variable.
// `lookup` returns a variable's value, or null where it is unset.
struct BlockingWait {
  bool on{false};
  Status status;
};
BlockingWait readBlockingWait(const std::function<const char*(const char*)>& lookup);
// The process's environment.
BlockingWait blockingWaitFromEnv();

} // namespace fairring
