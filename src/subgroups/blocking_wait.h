#pragma once

#include <functional>
#include <string>

#include "common/status.h"

namespace fairring {

// Whether a composed call's wait() blocks the host, read as ProcessGroupNCCL
// reads it (torch/csrc/distributed/c10d/Utils.hpp, getCvarBool over
// TORCH_NCCL_BLOCKING_WAIT then its old name NCCL_BLOCKING_WAIT,
// ProcessGroupNCCL.hpp): the first name set wins; y, yes, t, true and 1 are
// true, n, no, f, false and 0 false, in any case; any other value is an
// error (ProcessGroupNCCL's constructor raises), here naming the variable.
// `lookup` returns a variable's value, or null where it is unset.
struct BlockingWait {
  bool on{false};
  Status status;
};
BlockingWait readBlockingWait(const std::function<const char*(const char*)>& lookup);
// The process's environment.
BlockingWait blockingWaitFromEnv();

} // namespace fairring
