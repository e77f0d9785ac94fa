#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "pipeline/send_order.h"
#include "topology/rank_layout.h"
#include "transport/wire.h"

namespace fairring {

// The messages this rank has decided to send and not yet handed to its
// connections, and the order they leave in. One outbox per destination and
// track: a local peer, or all rail peers of a track (they share one writer, see
// PeerMesh). Decisions are made under the engine's lock, but sends happen
// after it on whichever thread made them, so one drainer at a time hands an
// outbox's messages over, in queue order: without it two threads could swap
// two slices' messages on one connection, and the deadlock argument needs
// each connection to carry reduce messages in global order (docs/design.md,
// "Tracks, staging and why it does not deadlock"). A reduce-track outbox is
// kept sorted by operation, and its front waits while SendOrder holds it
// ("Message order across kinds"). Not thread-safe: lives under the engine's lock.
class Outboxes {
 public:
  struct Message {
    std::string header;
    void* data{nullptr};
    size_t bytes{0};
    uint64_t seq{0};
    int64_t slice{0};
    int segment{0};
    int peer{0};
  };
  static constexpr int kRailPeers = -1;

  explicit Outboxes(const RankLayout& layout) : layout_(layout) {}

  // The outbox of messages to `peer`: the peer itself, or kRailPeers.
  int keyOf(int peer) const {
    return layout_.machineOf(peer) == layout_.machine() ? peer : kRailPeers;
  }

  // Operation `seq` will queue this many reduce-track messages for each local
  // peer and for the rail.
  void expect(uint64_t seq, int64_t perLocalPeer, int64_t toRail);

  enum class Queued {
    kQueued, // a drainer is at work on that outbox
    kStartDrainer, // none is: the caller starts one, drain(key, track), after the lock
    kUnannounced, // a reduce-track message its operation did not announce: an engine bug
  };
  Queued queue(Track track, Message message);

  // The next message that may leave outbox (key, track), or nullopt, and the
  // drainer stops: the outbox is empty, the connections are closed, or
  // SendOrder holds its front (queueing what it waits for starts a drainer
  // again). Messages of operations from `failSeq` on are dropped.
  std::optional<Message> next(int key, Track track, uint64_t failSeq, bool closed);

  // Operations from `seq` on have failed: they will queue nothing more.
  void dropFrom(uint64_t seq) {
    order_.dropFrom(seq);
  }
  // Whether operation `seq` still has messages to queue (once it finishes it
  // must not: that too would be an engine bug).
  bool expecting(uint64_t seq) const {
    return order_.expecting(seq);
  }

 private:
  struct Box {
    std::deque<Message> queue;
    bool draining{false};
  };

  const RankLayout& layout_;
  std::map<std::pair<int, Track>, Box> boxes_;
  SendOrder order_;
};

} // namespace fairring
