#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace fairring::plants {

// Test-only switches that put a known bug back, one each, so that a script
// (scripts/stream_mutants.sh) shows on every CI run that the tests still catch
// it: a plant kept only in someone's notes stops proving anything the day the
// code moves. Only the test module (tests/native/) arms them; production code
// never does, and an unarmed check is one relaxed atomic load.
enum class Plant : uint8_t {
  kFutureOnCallerStream, // the future marked with the caller's stream current
  kLaneSkipsCallerWait, // a lane's first step does not wait for the caller's stream
  kLanesNotJoined, // the done stream does not wait for the other lanes (L = 1)
  kKeepAliveOff, // the allocator is not told which streams use the caller's memory
  kByteRangesOff, // an allreduce does not wait for one in flight on the same bytes
  kDelegatedNotAfterAllreduce, // a delegated collective does not wait for allreduces in flight
  kAllreduceNotAfterDelegated, // an allreduce does not wait for a delegated collective in flight
  kBarrierNotWaiting, // barrier() does not wait for the device
  kRailSkipsReduceScatter, // the rail exchange does not wait for the local reduce-scatter
  kDelegatedHoldReleasedAtIssue, // the delegate's Work synchronized at issue (its hold emptied)
  kDirectThroughOurStreams, // a call that does not compose runs on fairring's streams
  kStepWaitsOnHost, // each step's collective waited for with wait() (blocks under blocking wait)
  kMeasuredOwnTimes, // the measured choice decided from this rank's own times, with no agreement
  kMeasuredFastestRank, // the measured choice combines the ranks' times by MIN, not MAX
  kTrialTimesNoWork, // a timed trial call that returned no Work (a synchronous one) is watched as if it had one
  kPointToPointMarksDelegate, // send/recv mark the delegate used, so only their ranks enter its barrier
  kEventlessWorkUnordered, // a delegated Work whose future carries no event is waited for through it alone
  kTrialsOnOneWayCalls, // a measured row's call that only the composition takes still takes a trial turn
  kAgreementByOrder, // the measured choice's agreements named by their order on the rank, not device and class
  kAnnouncementParked, // an announcement that comes before its call is left unread, stopping its gather track
  kCallbacksStartIgnoresLoss, // the callbacks' engine starts (and waits out the timeout) after its group lost a peer
  kTimeoutNamesNextPeer, // a timeout names the peer it waits for, not the rank at the end of the wait chain
  kRingLeftToProcess, // the Gloo group of a ring call given up on is never freed
  kCallbacksFailureStaysThere, // a failure of the callbacks' engine does not fail the program's calls
  kCloseWaitsReduceAbort, // a failed group's connections close only once the reduce track's abort left (or the grace)
  kReduceCloseNotHeld, // a peer's reduce track read as closed is its loss at once, before its gather track's abort
  kDelegatedUnannounced, // a CPU collective fairring does not run goes to Gloo at once, unannounced
  kBarrierBeforeHandOver, // barrier() does not wait for the announced calls before it to be on Gloo
  kWaitNoteByRank, // the wait chain follows a peer's latest note, not its note for the turn waited at
  kTimerOnPoolStream, // a device's trial timers record on the device's "new stream" (CUDA: torch's shared pool)
  kMeshConnectsInOrder, // start-up connects to its peers one by one, each waiting for the one before
  kSendFailureWaitsBriefly, // a failed send waits 500 ms for any track's reader to reach the close, then is the reason
  kHeldCloseIgnoresLateGather, // a held reduce-track close is the peer's loss after 500 ms, while its gather reader still reads
  kCount,
};

namespace detail {
extern std::atomic<uint64_t> gPlanted; // a bit per Plant: 0 in production
} // namespace detail

inline bool planted(Plant plant) {
  return (detail::gPlanted.load(std::memory_order_relaxed) >> static_cast<int>(plant)) & 1ULL;
}

// Every plant's name (the test module's and the script's), in Plant's order.
const std::vector<std::string>& names();
// For the test module: arm the plant called `name` (refused, naming the
// known ones, if there is none), and disarm all.
void arm(const std::string& name);
void disarmAll();

} // namespace fairring::plants
