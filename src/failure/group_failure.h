#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace fairring {

// The one owner of a process group's failure (docs/design.md, "Failure"):
// what the group failed with, from which turn on, what each caller is told,
// when the peers hear it and when the connections may close. The engine, its
// connections (through the engine), the completion of the user's futures (the
// barrier, the ring) ask it instead of keeping a failure of their own; the
// sub-group path can (it needs no engine). Thread-safe; asking a healthy group
// costs one atomic load.
//
// The rules, in one place:
//  - The first error is the reason: later calls and the aborts carry it.
//  - Operations from the failed turn on fail; earlier ones finish (a bad
//    call or a mismatch says nothing about them; a lost peer fails every
//    operation that needs it, from turn 0).
//  - The reason travels ahead of this rank's close: an abort to every peer on
//    every connection, ahead of the data still queued there, once every
//    connection exists; the connections close once every peer has taken the
//    one on its gather track (always read, so it is read before the close; a
//    reduce-track writer held at another peer's parked reduce track holds no
//    close: see PeerCloses for the other end), or kAbortGrace after they
//    were queued.
//  - A peer read as closed while an operation still needs it is the failure
//    at once: a peer that fails on purpose sends its reason on that very
//    connection before it closes, so a close read first has no reason behind
//    it (the peer died). One that closes while nothing needs it (it finished
//    and left) fails the next operation.
class GroupFailure {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr uint64_t kNone = UINT64_MAX;
  // How long a failed rank's connections stay open for its aborts to leave,
  // counted from when they were queued: a peer holding a reduce-track
  // connection at a message it cannot take yet does not read the abort queued
  // behind it there (it reads the one on the gather track, which is always read).
  static constexpr std::chrono::milliseconds kAbortGrace{2000};
  // How long a send that failed (the peer closed) waits for one of that peer's
  // readers to reach the close: the peer's abort, if it sent one, is read first.
  static constexpr std::chrono::milliseconds kSendFailureWait{500};

  // Operations from turn `fromSeq` on fail with `message`; the first message
  // stays the reason. Returns the turn that was failed before (kNone if the
  // group was healthy), or nullopt if nothing newly failed.
  std::optional<uint64_t> fail(const std::string& message, uint64_t fromSeq);

  bool failed() const {
    return failSeq_.load(std::memory_order_acquire) != kNone;
  }
  // Whether the operation at turn `seq` has failed (or will, once issued).
  bool fails(uint64_t seq) const {
    return seq >= failSeq_.load(std::memory_order_acquire);
  }
  uint64_t failSeq() const {
    return failSeq_.load(std::memory_order_acquire);
  }
  std::string reason() const; // empty while healthy
  // What a call at a failed turn raises.
  std::string refusal() const;

  // A peer is gone (closed, or a send to it or a read from it failed). Returns
  // the message to fail the group with now if an operation `needed` it; else
  // the next operation fails with it (departed()).
  std::optional<std::string> peerLost(const std::string& message, bool needed);
  std::optional<std::string> departed() const;

  // Aborts. An abort is due whenever fail() changed something while the group
  // is connected; before that it is held, and connected() hands it over.
  struct Abort {
    std::string reason;
    uint64_t fromSeq;
  };
  // After fail() returned a value: the abort to send now, or nullopt (held
  // until connected, or the group is stopping: its peers see the close).
  std::optional<Abort> abortDue(bool stopping);
  // Every connection exists: the abort held meanwhile, if any.
  std::optional<Abort> connected();
  // Returns the round the aborts belong to, for abortLeft.
  uint64_t abortsQueued(const std::vector<int>& peers, Clock::time_point now);
  void abortLeft(int peer, uint64_t round);
  // Whether the connections may close now (the group has failed): every peer
  // has taken the gather-track abort of the latest round, or kAbortGrace has
  // passed since they were queued.
  bool mayClose(Clock::time_point now) const;
  // Until when a shutdown waits for the aborts (now, if none are out).
  Clock::time_point abortsDeadline(Clock::time_point now) const;

  // What a rank reports for a reason a peer forwarded.
  static std::string forwarded(const std::string& reason, const std::string& me, const std::string& peer);

 private:
  mutable std::mutex mu_;
  std::atomic<uint64_t> failSeq_{kNone};
  std::string reason_;
  std::string departed_;
  bool connected_{false};
  bool abortHeld_{false};
  // The peers that have not taken an abort yet, each with the round it waits for.
  std::map<int, uint64_t> untold_;
  uint64_t abortRound_{0};
  Clock::time_point abortsQueuedAt_{};
};

} // namespace fairring
