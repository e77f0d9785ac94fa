#pragma once

#include <chrono>
#include <functional>
#include <vector>

namespace fairring {

// How waiting for the device to finish what a group issued ended.
enum class DrainEnd {
  kDrained, // every operation finished
  kFailed, // `failed` said so (checked first, so also when all else is done)
  kTimedOut, // the deadline passed first
};

const char* drainEndName(DrainEnd end);

// Polls, on the calling thread and holding nothing, until `failed` says
// there is no point waiting (a sub-group has reported an error, the group is
// being aborted), every one of `pending` says it is done, or `deadline`
// passes. Polls rather than blocks so that a peer that never comes
// cannot hold the caller past the deadline, as a device synchronize would.
DrainEnd drainUntil(
    const std::vector<std::function<bool()>>& pending,
    const std::function<bool()>& failed,
    std::chrono::steady_clock::time_point deadline);

} // namespace fairring
