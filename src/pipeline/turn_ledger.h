#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "pipeline/engine_lock.h"
#include "pipeline/operation.h"
#include "staging/staging_pool.h"

namespace fairring {

// The engine's turns and what holds them. Every call takes the next turn, the
// same number on every rank. The operations in flight are kept by turn;
// their slices start strictly in turn order, each staged one holding a slot
// of the staging pool (a slice that stages nothing still takes its place in
// that order: it keeps the reduce track's messages in order). A failed
// operation is buried, not freed, until the connections that may still read
// or write its memory are closed. Every method runs under the engine's lock.
class TurnLedger {
 public:
  TurnLedger(size_t totalMemory, size_t slotBytes) : staging_(totalMemory, slotBytes) {}

  // The next turn, taken: a call's, or the one a refused call would have had.
  uint64_t take(const Locked&) {
    return next_++;
  }
  uint64_t next(const Locked&) const {
    return next_;
  }
  Operation* find(uint64_t seq, const Locked&) const;
  // Puts `op` (its turn and slices set) in flight; its slices wait for their
  // place in turn order where `inOrder`.
  Operation& add(std::unique_ptr<Operation> op, bool inOrder, const Locked&);
  // The operation at `seq` finished: out of the ledger, to be completed.
  std::shared_ptr<Operation> retire(uint64_t seq, const Locked&);
  // Every operation from turn `fromSeq` on has failed: buried, and returned
  // so that their futures fail.
  std::vector<Operation*> bury(uint64_t fromSeq, const Locked&);
  // The connections are closed: no one reads or writes a buried operation's memory.
  void freeBuried(const Locked&) {
    buried_.clear();
  }
  bool empty(const Locked&) const {
    return ops_.empty();
  }
  const std::map<uint64_t, std::unique_ptr<Operation>>& inFlight(const Locked&) const {
    return ops_;
  }

  // The next slice whose place in turn order has come, with a slot taken for
  // it where its operation `stages`; nullopt where none waits or no slot is free.
  struct Ready {
    Operation* op;
    Slice* slice;
    bool staged;
  };
  std::optional<Ready> nextReady(const std::function<bool(const Operation&)>& stages, const Locked&);
  // A staged slice no longer needs its slot.
  void releaseSlot(Slice& slice, const Locked&);
  size_t slotBytes() const {
    return staging_.slotBytes();
  }

 private:
  uint64_t next_{0};
  std::map<uint64_t, std::unique_ptr<Operation>> ops_;
  std::vector<std::unique_ptr<Operation>> buried_;
  std::deque<std::pair<uint64_t, int64_t>> waitingForPlace_; // (turn, slice)
  StagingPool staging_;
};

} // namespace fairring
