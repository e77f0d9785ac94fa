#pragma once

#include <ATen/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <string>

namespace fairring {

// The calls handed to Gloo after an announcement on the engine
// (CollectiveEngine::announce): an allreduce on the ring, or a collective
// fairring does not run itself. Gloo pairs calls by issue order only: a call
// one rank skipped pairs its next with the others' skipped one, and a size
// that differs ends the process on Gloo's thread (gloo::EnforceNotMet).
enum class AnnouncedCall : uint8_t {
  kRingAllreduce = 0,
  kBroadcast,
  kReduce,
  kGather,
  kScatter,
  kAllToAll,
  kAllGatherCoalesced,
  kAllreduceSparse,
  kBlockCall, // a collective of a coalescing block (Gloo runs each alone)
};

// What an announcement says, alike on every rank of a valid program: the
// header of its message carries it, and a peer whose header differs fails the
// call on every rank, naming both.
struct Announced {
  AnnouncedCall call{AnnouncedCall::kRingAllreduce};
  int64_t numel{-1}; // -1 where ranks may pass different sizes (all_to_all's splits, sparse)
  at::ScalarType dtype{at::kFloat};
  c10d::ReduceOp::RedOpType op{c10d::ReduceOp::SUM}; // where it reduces
  int32_t root{-1}; // broadcast, reduce, gather, scatter
};

// As torch names the collective.
inline const char* announcedName(AnnouncedCall call) {
  switch (call) {
    case AnnouncedCall::kRingAllreduce: return "ring allreduce";
    case AnnouncedCall::kBroadcast: return "broadcast";
    case AnnouncedCall::kReduce: return "reduce";
    case AnnouncedCall::kGather: return "gather";
    case AnnouncedCall::kScatter: return "scatter";
    case AnnouncedCall::kAllToAll: return "all_to_all";
    case AnnouncedCall::kAllGatherCoalesced: return "all_gather_coalesced";
    case AnnouncedCall::kAllreduceSparse: return "sparse allreduce";
    case AnnouncedCall::kBlockCall: return "call of a coalescing block";
  }
  return "unknown call";
}

inline bool announcedReduces(AnnouncedCall call) {
  return call == AnnouncedCall::kRingAllreduce || call == AnnouncedCall::kReduce ||
      call == AnnouncedCall::kAllreduceSparse;
}

} // namespace fairring
