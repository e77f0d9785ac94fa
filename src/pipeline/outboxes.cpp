#include "pipeline/outboxes.h"

#include <iterator>

namespace fairring {

void Outboxes::expect(uint64_t seq, int64_t perLocalPeer, int64_t toRail) {
  const int L = layout_.localSize();
  for (int k = 1; k < L; ++k) {
    order_.expect(seq, layout_.rankOf(layout_.machine(), (layout_.localRank() + k) % L), perLocalPeer);
  }
  if (layout_.numMachines() > 1) {
    order_.expect(seq, kRailPeers, toRail);
  }
}

Outboxes::Queued Outboxes::queue(Track track, Message message) {
  const int key = keyOf(message.peer);
  if (track == Track::kReduce && !order_.queued(message.seq, key)) {
    return Queued::kUnannounced;
  }
  Box& box = boxes_[{key, track}];
  // On the reduce track, behind every message of its own or an earlier
  // operation: a message held by SendOrder must not hold an earlier one back.
  auto at = box.queue.end();
  while (track == Track::kReduce && at != box.queue.begin() && std::prev(at)->seq > message.seq) {
    --at;
  }
  box.queue.insert(at, std::move(message));
  if (box.draining) {
    return Queued::kQueued;
  }
  box.draining = true;
  return Queued::kStartDrainer;
}

std::optional<Outboxes::Message> Outboxes::next(int key, Track track, uint64_t failSeq, bool closed) {
  Box& box = boxes_[{key, track}];
  // Messages of failed operations are dropped; earlier ones still go.
  while (!box.queue.empty() && box.queue.front().seq >= failSeq) {
    box.queue.pop_front();
  }
  if (box.queue.empty() || closed || (track == Track::kReduce && !order_.mayLeave(box.queue.front().seq, key))) {
    if (closed) {
      box.queue.clear();
    }
    box.draining = false;
    return std::nullopt;
  }
  Message next = std::move(box.queue.front());
  box.queue.pop_front();
  return next;
}

} // namespace fairring
