#pragma once

#include <cstdint>
#include <map>

namespace fairring {

// The order of reduce-track messages on every connection: a message of
// operation X leaves for a destination only once every earlier operation has
// queued all of its reduce-track messages for that destination. So each
// reduce-track connection carries its messages in the global issue order of
// operations of every kind, whatever order the state machine decides them in
// (an all-gather sends along the rail at activation, an allreduce only after
// its local reduction), and a receiver that stops reading at a message of an
// operation it has not posted yet never has an earlier operation's message
// stuck behind it (docs/design.md, "Message order across kinds").
//
// A destination is an outbox key: a local peer, or all rail peers (which
// share one writer). Each operation announces at admission how many messages
// it will queue for each destination; the result track needs no such rule (a
// result only ever goes to a rank that has posted its operation).
class SendOrder {
 public:
  // Operation `seq` will queue `count` reduce-track messages for `key`.
  void expect(uint64_t seq, int key, int64_t count);

  // Operation `seq` queues one message for `key`. False if it had announced
  // fewer: an engine bug, which must fail loudly rather than reorder.
  bool queued(uint64_t seq, int key);

  // Whether a queued message of `seq` may leave for `key` now.
  bool mayLeave(uint64_t seq, int key) const;

  // Operations from `seq` on have failed: they will queue nothing more.
  void dropFrom(uint64_t seq);

  // Whether operation `seq` still has messages to queue anywhere (once it
  // has finished it must not: that too would be an engine bug).
  bool expecting(uint64_t seq) const;

 private:
  // Per destination: operations that still have messages to queue there,
  // with how many.
  std::map<int, std::map<uint64_t, int64_t>> open_;
};

} // namespace fairring
