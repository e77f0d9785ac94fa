#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fairring::faults {

// Test-only fault points: named places in the transport and the engine where a
// test makes this process wait, throw or close, so that an interleaving that
// load produces now and then happens every time (docs/design.md, "Fault
// points"). Only the test module (tests/native/) arms them; production code
// never does. While nothing is armed a point costs one relaxed atomic load and
// a branch that is always predicted right: that is all a production build pays.
enum class Action : uint8_t {
  kDelay, // sleep, then go on
  kThrow, // throw std::runtime_error (a reduction that fails)
  kClose, // the caller closes what it holds (a connection)
};

// Every point the core has, in one table: call sites name a point by one of
// these constants, and arm() refuses any other name, so a renamed or removed
// point cannot go silently inert under a test that arms the old name.
inline constexpr const char* kMeshConnect = "mesh.connect"; // key: the peer; before connecting to it
inline constexpr const char* kMeshSendFirst = "mesh.send.first"; // key: the peer; an abort, before it is written
inline constexpr const char* kMeshSendFirstReduce = "mesh.send.first.reduce"; // key: the peer; an abort on the reduce track, before it is written
inline constexpr const char* kMeshReadClose = "mesh.read.close"; // key: the peer; before a body is read
inline constexpr const char* kEngineStart = "engine.start"; // no key; between connecting and the watchdog
inline constexpr const char* kEngineReduce = "engine.reduce"; // key: the turn; a reduction, before it runs
inline constexpr const char* kEngineAbort = "engine.abort"; // key: the peer; its abort read, not yet acted on
inline constexpr const char* kEngineLost = "engine.lost"; // key: the peer; its connection read as closed, not yet acted on
inline constexpr const char* kSubgroupsIssue = "subgroups.issue"; // key: the turn; a composed call, before it is issued
inline constexpr const char* kMeasuredDecide = "measured.decide"; // key: the class's first byte; before its agreement (throw: this rank cannot take part)
inline constexpr const char* kMeasuredTrialDone = "measured.trial_done"; // key: the call; a host trial call's end, before it is kept (throw: its timer fails)
inline constexpr const char* kGlooHandOver = "gloo.hand_over"; // no key; a call, before it is handed to Gloo (gloo_calls.h)
inline constexpr std::array<std::string_view, 12> kPoints{
    kMeshConnect,
    kMeshSendFirst,
    kMeshSendFirstReduce,
    kMeshReadClose,
    kEngineStart,
    kEngineReduce,
    kEngineAbort,
    kEngineLost,
    kSubgroupsIssue,
    kMeasuredDecide,
    kMeasuredTrialDone,
    kGlooHandOver};

struct Fault {
  Action action{Action::kDelay};
  std::chrono::milliseconds delay{0};
};

namespace detail {
extern std::atomic<int> gArmed; // how many points are armed: 0 in production
std::optional<Fault> take(const char* point, int64_t key);
} // namespace detail

// What is armed at `point` for `key` (a peer's rank, an operation's turn; -1
// where the point has none), consuming one use; nullopt almost always.
inline std::optional<Fault> at(const char* point, int64_t key = -1) {
  if (detail::gArmed.load(std::memory_order_relaxed) == 0) {
    return std::nullopt;
  }
  return detail::take(point, key);
}

// at(), with delays slept and throws thrown here; true where armed to close.
bool hit(const char* point, int64_t key = -1);

// For the test module: arm `point` (one of kPoints, else std::invalid_argument)
// for `times` uses (matching `key`, or any key if -1), disarm everything, and
// count the uses so far.
void arm(const std::string& point, Action action, std::chrono::milliseconds delay, int times, int64_t key);
void disarmAll();
int uses(const std::string& point);
// When `point` last fired (seconds since the epoch, the system clock, as Python's
// time.time()), 0 where it never did: a test's fault is timed from its own moment.
double lastUse(const std::string& point);

} // namespace fairring::faults
