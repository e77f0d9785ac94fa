#include "pipeline/wait_chain.h"

#include <deque>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "faults/plants.h"

namespace fairring {

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kChainPoll = std::chrono::milliseconds(5);

std::string latestKey(int rank) {
  return "waits/" + std::to_string(rank);
}

std::string turnKey(int rank, uint64_t seq) {
  return latestKey(rank) + "/" + std::to_string(seq);
}

std::string noteText(uint64_t seq, const std::vector<int>& ranks) {
  std::string text = std::to_string(seq) + ":";
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i ? "," : "") + std::to_string(ranks[i]);
  }
  return text;
}

std::optional<WaitLink> parse(int rank, const std::vector<uint8_t>& raw, int worldSize) {
  const std::string text(raw.begin(), raw.end());
  const size_t colon = text.find(':');
  if (colon == std::string::npos) {
    return std::nullopt;
  }
  try {
    WaitLink link{rank, std::stoull(text.substr(0, colon)), {}};
    std::istringstream in(text.substr(colon + 1));
    for (std::string item; std::getline(in, item, ',');) {
      const int r = std::stoi(item);
      if (r < 0 || r >= worldSize) {
        return std::nullopt;
      }
      link.ranks.push_back(r);
    }
    return link;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// Whether `peer` has a note to follow from a wait at `seq`: its note for
// `seq`, else its latest. Empty while it has none (the caller polls).
std::optional<std::vector<uint8_t>> noteOf(c10d::Store& store, int peer, uint64_t seq) {
  if (!plants::planted(plants::Plant::kWaitNoteByRank) && store.check({turnKey(peer, seq)})) {
    return store.get(turnKey(peer, seq));
  }
  if (store.check({latestKey(peer)})) {
    return store.get(latestKey(peer));
  }
  return std::nullopt;
}

} // namespace

void writeWaitNote(c10d::Store& store, int rank, uint64_t seq, const std::vector<int>& waited) {
  const std::string text = noteText(seq, waited);
  const std::vector<uint8_t> bytes(text.begin(), text.end());
  store.set(turnKey(rank, seq), bytes);
  store.set(latestKey(rank), bytes);
}

void followWaitChain(
    c10::intrusive_ptr<c10d::Store> store,
    int me,
    uint64_t seq,
    std::vector<int> waited,
    int worldSize,
    Clock::time_point deadline,
    std::shared_ptr<WaitChain> chain) {
  auto finish = [&](int silent) {
    std::lock_guard<std::mutex> lock(chain->mu);
    chain->silent = silent;
    chain->done = true;
    chain->cv.notify_all();
  };
  try {
    writeWaitNote(*store, me, seq, waited);
    std::set<int> seen{me};
    std::deque<std::pair<int, uint64_t>> next; // (rank, the turn it is waited for at)
    for (int r : waited) {
      next.emplace_back(r, seq);
    }
    while (!next.empty()) {
      const auto [peer, at] = next.front();
      next.pop_front();
      if (!seen.insert(peer).second) {
        continue;
      }
      std::optional<WaitLink> theirs;
      for (;;) {
        if (auto raw = noteOf(*store, peer, at)) {
          theirs = parse(peer, *raw, worldSize); // none: not a note of ours
          break;
        }
        if (Clock::now() >= deadline) {
          break;
        }
        std::this_thread::sleep_for(kChainPoll);
      }
      if (!theirs) {
        finish(peer);
        return;
      }
      for (int r : theirs->ranks) {
        next.emplace_back(r, theirs->seq);
      }
      std::lock_guard<std::mutex> lock(chain->mu);
      chain->links.push_back(std::move(*theirs));
    }
  } catch (const std::exception&) {
    // The store failed: what was read stands.
  }
  finish(-1);
}

} // namespace fairring
