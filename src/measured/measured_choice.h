#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "measured/agreement.h"
#include "measured/trial_order.h"
#include "measured/trial_timer.h"

namespace fairring {

// How much faster per byte (the slowest rank's medians) the way that replaces the
// program's own must be. Where both ways move the same bytes (one rank per
// machine) the trials tie within noise, and the way chosen on a tie ran up to
// 11% slower afterwards (the engine, 4 x 1, 25 MiB at 300 Mbit/s: 1,097 ms in
// the trials against the ring's 1,101, then 1,228 against Gloo's 1,107); a
// margin above the trials' noise keeps what the program had.
constexpr double kMeasuredMargin = 0.05;

// One size class's decision: the way its calls run from kDecisionCall on.
struct MeasuredDecision {
  size_t fromBytes{0};
  size_t toBytes{0}; // exclusive; 0: no upper end
  int winner{0}; // 0 or 1, as MeasuredOptions::ways
  // Per way: the slowest rank's seconds for a timed call at its median speed
  // (of its kTimedCalls), and those calls' mean bytes (the same calls on every rank).
  std::array<double, 2> seconds{};
  std::array<double, 2> bytes{};
  bool fromFile{false}; // FAIRRING_PLAN_FILE's, not measured in this job
  // Non-empty: some rank could not time its trial calls, and every rank keeps
  // the program's own way (MeasuredOptions::kept); why, as every rank says it.
  std::string keptBecause;
};

struct MeasuredOptions {
  std::string device; // "cpu", "cuda": what the decisions say
  std::array<std::string, 2> ways; // ("engine", "ring"), ("nccl", "composed")
  // The way the program had without fairring (Gloo's ring: 1; NCCL's own: 0):
  // the other replaces it only where measured faster by more than kMeasuredMargin.
  int kept{0};
  // The device's plan: where each row starts, and whether its calls are
  // measured (a class of their own each) or run the way the plan says.
  std::vector<std::pair<size_t, bool>> rows;
  // FAIRRING_PLAN_FILE's decisions (rank 0 read the file and every rank the
  // same copy): those classes run their winner from their first call.
  std::vector<MeasuredDecision> known;
  int rank{0};
  int size{0};
  std::chrono::milliseconds timeout{0};
  // The job's store (the group's prefix): the agreements' keys (agreement.h).
  c10::intrusive_ptr<c10d::Store> store;
  // Told of every decision this rank makes, on the deciding thread with no
  // lock held: (device, the decision as JSON). fairring_pg sets it on rank 0
  // only (fairring_pg.measured: the log line, once, and the file); unset on
  // the other ranks.
  std::function<void(const std::string&, const std::string&)> onDecision;
};

// FAIRRING_*_ALLREDUCE=auto's measured choice between two ways of running an
// allreduce (docs/design.md, "The measured choice"), for one device's calls.
// Each measured row of the plan is a size class; its calls take turns by their
// number in the class (trial_order.h), so alike on every rank; at the decision
// call each rank waits for its own timings (each way's median), the ranks combine
// them through the store (agreement.h: the slowest rank's count), and every
// rank runs the faster way from that call on; where some rank could not time
// its calls, every rank keeps the program's own way. Every call is one way on
// every rank, so exact throughout.
//
// Why it cannot deadlock: the agreement is made at the same call of the
// class on every rank, under keys that name the device and the class, so it
// pairs with nothing else whatever order other threads' calls come in; what a
// rank waits for before it (its own trial calls) was issued by every rank
// before that call, so completes without anything this rank issues later.
// Waits hold no lock (and not the GIL) and end at the group's timeout, when a
// rank says it cannot take part, or when the group stops.
class MeasuredChoice {
 public:
  struct Turn {
    size_t row{0};
    int64_t call{0}; // the call's number in its class
    int way{0};
    bool timed{false};
    size_t bytes{0};
  };

  explicit MeasuredChoice(MeasuredOptions options);

  MeasuredChoice(const MeasuredChoice&) = delete;
  MeasuredChoice& operator=(const MeasuredChoice&) = delete;

  // Whether the calls of plan row `row` are measured.
  bool measures(size_t row) const;
  // The way the next call of measured row `row` (of `bytes` bytes) runs: a
  // trial, or the class's winner. Only calls every rank counts alike may ask
  // (the program's own, of a kind both ways run). At the class's decision call
  // it decides first: where some rank could not time its trial calls, the
  // class keeps the program's own way on every rank; where the ranks could not
  // agree, it throws on every rank alike, as every later call of the class
  // then does.
  Turn next(size_t row, size_t bytes);
  // A timed turn's timer, once its call was issued (or raised).
  void keep(const Turn& turn, std::shared_ptr<TrialTimer> timer);

  std::vector<MeasuredDecision> decisions() const;
  const std::array<std::string, 2>& ways() const {
    return options_.ways;
  }
  // destroy or abort: a decision's waits end (failing the class).
  void stop();

 private:
  // A class's life, one value.
  enum class State : uint8_t {
    kTrying, // calls 0 .. kDecisionCall-1: the trials, in trial_order's order
    kDeciding, // the decision call waits for its timings and the other ranks
    kDecided, // every call runs the winner
    kFailed, // the ranks could not agree: every call raises why
  };
  struct Timed {
    int way{0};
    size_t bytes{0};
    std::shared_ptr<TrialTimer> timer;
  };
  struct Class {
    size_t fromBytes{0};
    size_t toBytes{0};
    State state{State::kTrying};
    int64_t calls{0};
    std::vector<Timed> timed;
    MeasuredDecision decision;
    std::string failure;
  };
  struct Outcome {
    std::optional<MeasuredDecision> decision;
    std::string failure;
  };

  // Waits for this rank's timings and agrees with the other ranks.
  Outcome decide(size_t fromBytes, size_t toBytes, const std::vector<Timed>& timed);
  Agreed agree(
      size_t fromBytes,
      const RankFigures& mine,
      TrialTimer::Clock::time_point deadline,
      const Agreement::Stop& stop);
  std::string range(size_t fromBytes, size_t toBytes) const;

  const MeasuredOptions options_;
  const Agreement agreement_;
  std::vector<int> classOfRow_; // -1: not measured
  mutable std::mutex mu_;
  std::condition_variable decided_; // a class left kDeciding
  std::vector<Class> classes_;
  std::atomic<bool> stopped_{false};
};

// A decision as the hook and the plan file read it (JSON).
std::string decisionJson(const std::string& device, const std::array<std::string, 2>& ways, const MeasuredDecision& d);

} // namespace fairring
