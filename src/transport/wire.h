#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace fairring {

// Traffic classes get separate connections. A connection delivers in order, and a
// receiver may hold a "reduce" message until a staging slot frees; slots free
// only when "gather" messages arrive, so those must never queue behind it.
enum class Track : uint8_t { kReduce = 0, kGather = 1 };
constexpr int kNumTracks = 2;

// Where a data message goes: to a rank of the same machine or along the
// rail, and on which track. The first two are the way to a reduction (the
// reduce track: a receiver may hold them for a slot), the "back" ones carry
// results (the gather track: never held). What a message means is its
// operation kind's (pipeline/steps.h, KindSteps::label); the byte on the wire
// is the value.
enum class Route : uint8_t {
  kWithinMachine = 0,
  kAlongRail = 1,
  kAlongRailBack = 2,
  kWithinMachineBack = 3,
};
constexpr int kNumRoutes = 4;

inline bool withinMachine(Route r) {
  return r == Route::kWithinMachine || r == Route::kWithinMachineBack;
}

inline Track trackOf(Route r) {
  return (r == Route::kWithinMachine || r == Route::kAlongRail) ? Track::kReduce : Track::kGather;
}

// What precedes every data message. It carries the sender's view of the
// operation so that a receiver can name exactly what differs between ranks.
struct DataHeader {
  uint64_t opSeq{0};
  int64_t slice{0};
  int32_t segment{0}; // of the slice (see SliceCuts)
  Route route{Route::kWithinMachine};
  int64_t numel{0}; // allreduce: the tensor; reduce-scatter, all-gather: one rank's part
  int8_t dtype{0};
  uint8_t op{0};
  uint8_t kind{0}; // OpKind: an allreduce must not pair with a reduce-scatter of equal size
  // Which of the pieces one (peer, route) sends per segment: a reduce-scatter
  // sends a local peer the parts of M ranks, an all-gather forwards M parts.
  int32_t piece{0};
  // An announcement's (OpKind::kAnnounce): which call Gloo is handed, and its
  // root where it has one (announced.h).
  uint8_t call{0};
  int32_t root{-1};
};

std::string encode(const DataHeader& h);
std::optional<DataHeader> decodeData(const std::string& bytes);
// The last message a failing rank sends to each peer, on every track (a
// receiver may be holding either at a parked message): the first error, so
// that ranks that never talked to the culprit still learn who it was.
struct Abort {
  std::string reason;
  // Operations from this sequence number on fail; earlier ones may finish
  // (a mismatch in one allreduce says nothing about the ones before it).
  uint64_t fromSeq{0};
};

std::string encode(const Abort& a);
std::optional<Abort> decodeAbort(const std::string& bytes);

} // namespace fairring
