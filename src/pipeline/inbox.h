#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "pipeline/engine_lock.h"
#include "transport/wire.h"

namespace fairring {

// A message that came before this rank could take it: its operation not yet
// posted here (the peer is ahead), or its slice not yet started.
struct Parked {
  int peer;
  DataHeader header;
  size_t bytes;
  // An empty gather-track message read on arrival, so that its connection
  // reads on: it is only counted when delivered.
  bool consumed{false};
};

// The engine's parked messages, by (turn, slice), until the slice starts
// (take) or the turn fails (dropFrom). A connection whose message is parked
// unread stops there; so every message parked is one some slice will take or
// a failure will drop. Every method runs under the engine's lock.
class Inbox {
 public:
  void park(Parked parked, const Locked&);
  // What waits for the slice (`seq`, `slice`), in arrival order, taken out.
  std::vector<Parked> take(uint64_t seq, int64_t slice, const Locked&);
  // Whether `peer`'s message for `segment` of that slice on `route` is here.
  bool holds(uint64_t seq, int64_t slice, int segment, int peer, Route route, const Locked&) const;
  // Every message from turn `fromSeq` on, dropped; returns those whose body
  // is unread (to be read and thrown away: what queues behind them must arrive).
  std::vector<Parked> dropFrom(uint64_t fromSeq, const Locked&);

 private:
  std::map<std::pair<uint64_t, int64_t>, std::vector<Parked>> parked_;
};

} // namespace fairring
