// The wait chain: whom to name when an operation times out.
//
// A rank that times out waits for some peers, which may be alive and waiting
// for others in turn: in a 2 x 2 job with rank 2 frozen, rank 1 can time out
// first, waiting for rank 3's reduction, which waits for rank 2. Naming rank 3
// would send the user to the wrong machine. So every rank whose oldest
// operation has waited half the timeout writes whom it waits for to the
// group's store (once per operation, under its turn: wait_chain.h; a
// healthy job writes nothing; a rank blocked that long in a collective of the
// delegate's, a broadcast from a frozen root, waits for every other rank, as
// far as it can tell), and a rank that times out follows those notes
// from the ranks it waits for until one that wrote none: frozen, or not at
// this call for half the timeout. That rank is named.
//
// The store may be out of reach when it matters most (its host frozen), so
// nothing here runs on the watchdog's thread: a note is written, and the chain
// read, by a thread of its own that holds no part of the engine, and the
// watchdog waits for the chain at most kChainWait.

#include <memory>
#include <thread>
#include <utility>

#include "faults/plants.h"
#include "pipeline/collective_engine.h"
#include "pipeline/wait_chain.h"

namespace fairring {

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kChainWait = std::chrono::milliseconds(400);

} // namespace

void CollectiveEngine::noteLongWaits(const Locked& locked) {
  const auto now = Clock::now();
  const auto halfway = options_.timeout / 2;
  for (auto& [seq, op] : ledger_.inFlight(locked)) {
    if (op->waitsNoted) {
      continue;
    }
    if (now < op->deadline - halfway) {
      break; // the oldest not yet noted is young: so are the rest
    }
    op->waitsNoted = true;
    std::vector<int> waited;
    describeWait(*op, waited);
    if (!waited.empty()) { // else a slot (an older operation's note says why), or its sends
      note(seq, std::move(waited));
      return;
    }
  }
  // Blocked in the delegate's collective (a broadcast from a frozen root): it
  // waits for every other rank, as far as anyone here can tell.
  if (delegated_->takeOldBefore(now - halfway)) {
    std::vector<int> others;
    for (int r = 0; r < layout_.worldSize(); ++r) {
      if (r != layout_.rank()) {
        others.push_back(r);
      }
    }
    note(ledger_.next(locked), std::move(others));
  }
}

void CollectiveEngine::note(uint64_t seq, std::vector<int> waited) {
  if (!store_) {
    return;
  }
  // Its own thread: the store's host may be the rank that froze.
  std::thread([store = store_, rank = layout_.rank(), seq, waited = std::move(waited)] {
    try {
      writeWaitNote(*store, rank, seq, waited);
    } catch (const std::exception&) {
    }
  }).detach();
}

std::string CollectiveEngine::blame(uint64_t seq, const std::vector<int>& waited) {
  if (!store_ || waited.empty() || plants::planted(plants::Plant::kTimeoutNamesNextPeer)) {
    return "";
  }
  auto chain = std::make_shared<WaitChain>();
  const auto deadline = Clock::now() + kChainWait;
  std::thread(followWaitChain, store_, layout_.rank(), seq, waited, layout_.worldSize(), deadline, chain).detach();
  std::unique_lock<std::mutex> lock(chain->mu);
  chain->cv.wait_until(lock, deadline + kChainWait / 4, [&] { return chain->done; });
  std::string text;
  for (const WaitLink& link : chain->links) {
    std::string whom;
    for (int r : link.ranks) {
      whom += (whom.empty() ? "" : ", ") + layout_.describe(r);
    }
    text += "; " + layout_.describe(link.rank) + " waits for " + whom + " (at #" + std::to_string(link.seq) + ")";
  }
  if (chain->silent >= 0) {
    text += "; " + layout_.describe(chain->silent) + " has not been waiting for anyone for half the timeout (" +
        "it is frozen, or not at this call)";
  } else if (!chain->done) {
    text += "; the store did not answer within " + std::to_string(kChainWait.count()) + " ms";
  }
  return text;
}

} // namespace fairring
