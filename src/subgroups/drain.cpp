#include "subgroups/drain.h"

#include <algorithm>
#include <thread>

namespace fairring {

const char* drainEndName(DrainEnd end) {
  switch (end) {
    case DrainEnd::kDrained:
      return "drained";
    case DrainEnd::kFailed:
      return "failed";
    case DrainEnd::kTimedOut:
      return "timed out";
  }
  return "unknown";
}

DrainEnd drainUntil(
    const std::vector<std::function<bool()>>& pending,
    const std::function<bool()>& failed,
    std::chrono::steady_clock::time_point deadline) {
  size_t next = 0; // those before it are done: operations end in about issue order
  // Short sleeps first: most drains end within a millisecond or two.
  auto pause = std::chrono::microseconds(50);
  while (true) {
    // A failure wins even over a finished drain: a sub-group in error is
    // aborted, never shut down gracefully (NCCL's graceful end waits for it).
    if (failed()) {
      return DrainEnd::kFailed;
    }
    while (next < pending.size() && pending[next]()) {
      ++next;
    }
    if (next == pending.size()) {
      return DrainEnd::kDrained;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return DrainEnd::kTimedOut;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(10));
  }
}

} // namespace fairring
