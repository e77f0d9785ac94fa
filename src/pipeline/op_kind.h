#pragma once

#include <cstdint>

namespace fairring {

// The collectives the engine runs. Every message carries its operation's kind,
// so that ranks that issue different collectives at the same turn fail with
// both named instead of pairing messages of equal size.
enum class OpKind : uint8_t {
  kAllreduce = 0,
  kReduceScatter = 1, // W parts in, this rank's part (reduced over all ranks) out
  kAllGather = 2, // this rank's part in, all W parts out
  // An allreduce of nothing: it completes on a rank only once every rank has
  // posted it, and fails wherever the group failed at or before its turn.
  kBarrier = 3,
  // A call handed to Gloo's ring, announced at its turn (its size, dtype and
  // op in the headers): one empty message to each local and rail peer, on the
  // gather track, no slot (announce_steps.cpp).
  kAnnounce = 4,
};

// As torch names the collective.
inline const char* opKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kAnnounce: return "call handed to Gloo";
  }
  return "unknown collective";
}

} // namespace fairring
