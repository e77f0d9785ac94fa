// The wait chain: whom to name when an operation times out.
//
// A rank that times out waits for some peers, which may be alive and waiting
// for others in turn: in a 2 x 2 job with rank 2 frozen, rank 1 can time out
// first, waiting for rank 3's reduction, which waits for rank 2. Naming rank 3
// would send the user to the wrong machine. So every rank whose oldest
// operation has waited half the timeout writes whom it waits for to the
// group's store ("waits/<rank>" = "<turn>:<ranks>", once per operation, so a
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

#include <condition_variable>
#include <deque>
#include <memory>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "faults/plants.h"
#include "pipeline/collective_engine.h"

namespace fairring {

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kChainWait = std::chrono::milliseconds(400);
constexpr auto kChainPoll = std::chrono::milliseconds(5);

std::string waitsKey(int rank) {
  return "waits/" + std::to_string(rank);
}

std::string noteText(uint64_t seq, const std::vector<int>& ranks) {
  std::string text = std::to_string(seq) + ":";
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i ? "," : "") + std::to_string(ranks[i]);
  }
  return text;
}

struct Waits {
  uint64_t seq{0};
  std::vector<int> ranks;
};

std::optional<Waits> parse(const std::string& text, int worldSize) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos) {
    return std::nullopt;
  }
  try {
    Waits w;
    w.seq = std::stoull(text.substr(0, colon));
    std::istringstream in(text.substr(colon + 1));
    for (std::string item; std::getline(in, item, ',');) {
      const int r = std::stoi(item);
      if (r < 0 || r >= worldSize) {
        return std::nullopt;
      }
      w.ranks.push_back(r);
    }
    return w;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// What the reading thread found, shared with the watchdog, which may stop
// waiting for it (then the thread finishes alone, touching only this).
struct Chain {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<int, Waits>> links; // each rank read, in order
  int silent{-1}; // the first rank with no note by the deadline
  bool done{false};
};

void readChain(
    c10::intrusive_ptr<c10d::Store> store,
    int me,
    std::string mine,
    std::vector<int> waited,
    int worldSize,
    Clock::time_point deadline,
    std::shared_ptr<Chain> chain) {
  auto finish = [&](int silent) {
    std::lock_guard<std::mutex> lock(chain->mu);
    chain->silent = silent;
    chain->done = true;
    chain->cv.notify_all();
  };
  try {
    store->set(waitsKey(me), std::vector<uint8_t>(mine.begin(), mine.end()));
    std::set<int> seen{me};
    std::deque<int> next(waited.begin(), waited.end());
    while (!next.empty()) {
      const int peer = next.front();
      next.pop_front();
      if (!seen.insert(peer).second) {
        continue;
      }
      std::optional<Waits> theirs;
      while (!theirs) {
        if (store->check({waitsKey(peer)})) {
          const std::vector<uint8_t> raw = store->get(waitsKey(peer));
          theirs = parse(std::string(raw.begin(), raw.end()), worldSize);
          if (!theirs) {
            break; // not a note of ours
          }
        } else if (Clock::now() >= deadline) {
          break;
        } else {
          std::this_thread::sleep_for(kChainPoll);
        }
      }
      if (!theirs) {
        finish(peer);
        return;
      }
      for (int r : theirs->ranks) {
        next.push_back(r);
      }
      std::lock_guard<std::mutex> lock(chain->mu);
      chain->links.emplace_back(peer, std::move(*theirs));
    }
  } catch (const std::exception&) {
    // The store failed: what was read stands.
  }
  finish(-1);
}

} // namespace

void CollectiveEngine::noteLongWaits() {
  const auto now = Clock::now();
  const auto halfway = options_.timeout / 2;
  for (auto& [seq, op] : ops_) {
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
    note(nextSeq_, std::move(others));
  }
}

void CollectiveEngine::note(uint64_t seq, std::vector<int> waited) {
  if (!store_) {
    return;
  }
  // Its own thread: the store's host may be the rank that froze.
  std::thread([store = store_, key = waitsKey(layout_.rank()), text = noteText(seq, waited)] {
    try {
      store->set(key, std::vector<uint8_t>(text.begin(), text.end()));
    } catch (const std::exception&) {
    }
  }).detach();
}

std::string CollectiveEngine::blame(uint64_t seq, const std::vector<int>& waited) {
  if (!store_ || waited.empty() || plants::planted(plants::Plant::kTimeoutNamesNextPeer)) {
    return "";
  }
  auto chain = std::make_shared<Chain>();
  const auto deadline = Clock::now() + kChainWait;
  std::thread(readChain, store_, layout_.rank(), noteText(seq, waited), waited, layout_.worldSize(), deadline, chain)
      .detach();
  std::unique_lock<std::mutex> lock(chain->mu);
  chain->cv.wait_until(lock, deadline + kChainWait / 4, [&] { return chain->done; });
  std::string text;
  for (const auto& [rank, theirs] : chain->links) {
    std::string whom;
    for (int r : theirs.ranks) {
      whom += (whom.empty() ? "" : ", ") + layout_.describe(r);
    }
    text += "; " + layout_.describe(rank) + " waits for " + whom + " (at #" + std::to_string(theirs.seq) + ")";
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
