#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fairring {

// What one rank brings to a class's agreement: its time of a call at each
// way's median speed, or why it has none.
struct RankFigures {
  std::array<double, 2> seconds{};
  std::string cannotTime; // non-empty: this rank could not time its trial calls
};

// What every rank reads from the agreement, the same on every rank.
struct Agreed {
  // Per way, the slowest rank's seconds (where every rank timed its calls).
  std::array<double, 2> seconds{};
  // The lowest rank that could not time its calls (-1: none), and why.
  int cannotTimeRank{-1};
  std::string cannotTime;
  // Non-empty: the agreement failed (a rank could not take part, it was
  // stopped, or some rank did not come within the timeout); the call fails
  // on every rank with it.
  std::string failure;
};

// The ranks' agreement on one size class's decision, through the job's store:
// each rank writes its figures under a key named by the device and the class
// (and its rank), then reads every rank's. Every rank reads the same W values
// and combines them alike, so every rank reaches the same verdict; a key names
// one agreement, so two agreements cannot pair with each other (a collective
// on a group pairs calls by issue order only: the CPU and accelerator
// threads', or two classes' from two threads, could meet in another order on
// another rank). A rank that cannot take part writes why instead, and every
// rank fails the call at once; the wait polls, so a stop ends it.
class Agreement {
 public:
  using Stop = std::function<bool()>;

  Agreement(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string device);

  // `fromBytes`: the class (its first byte), which names the keys. `mine` empty:
  // this rank cannot take part (the reason is `failure`).
  Agreed combine(
      size_t fromBytes,
      const std::optional<RankFigures>& mine,
      const std::string& failure,
      std::chrono::steady_clock::time_point deadline,
      const Stop& stop) const;

 private:
  // The agreement's name: the device and the class.
  std::string name(size_t fromBytes) const;
  static std::string key(const std::string& name, int rank);
  // Every rank's figures (`values`: every rank's, each timed or untimed),
  // combined as every rank combines them.
  Agreed combined(const std::vector<std::optional<std::string>>& values) const;
  // Best effort: a failing rank's reason, so that the others stop waiting.
  void tell(const std::string& name, const std::string& failure) const;

  const c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  const std::string device_;
};

} // namespace fairring
