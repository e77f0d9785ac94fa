// The steps of an announcement (a call handed to Gloo: announced.h), on rank
// (m, l): an empty message, whose header says the call (announced.h), to each
// local rank and each rank of rail l, on the gather track; nothing staged,
// nothing reduced, one hop.
//
//   at activation: the header to each (m, l') and each (m', l)
//   1. exchange    every local and rail peer's header is here (each checked
//                  against this rank's on arrival), every send is out
//
// Why rail and machine peers suffice: a rank's announcement completes only
// once its header matched those of its machine and its rail, so any two
// ranks (m, l) and (m', l') that both complete matched (m, l'), which is on
// the first's machine and the second's rail: no two ranks hand Gloo
// different calls. A rank that saw a mismatch fails the group at that turn,
// and every rank learns it (GroupFailure). Its messages come on the gather
// track, which a receiver never stops reading for them: one that arrives
// before this rank's call is read at once (CollectiveEngine::park).

#include "pipeline/steps.h"

namespace fairring {

namespace {

enum Step : uint8_t {
  kExchange,
  kNumSteps,
};

class AnnounceSteps final : public KindSteps {
 public:
  using KindSteps::KindSteps;

  int numSteps() const override {
    return kNumSteps;
  }

  const char* stepName(int step) const override {
    return step == kExchange ? "exchange headers" : "done";
  }

  void open(Turn& t) const override {
    for (int k = 1; k < L; ++k) {
      t.ctx.send(t, layout_.rankOf(m, (l + k) % L), Route::kWithinMachineBack, 0, nullptr, 0);
    }
    for (int k = 1; k < M; ++k) {
      t.ctx.send(t, layout_.rankOf((m + k) % M, l), Route::kAlongRailBack, 0, nullptr, 0);
    }
  }

  Next run(Turn& t) const override {
    if (t.seg.step != kExchange) {
      return Next::kWait;
    }
    const bool all = t.seg.got(Route::kWithinMachineBack) >= L - 1 && t.seg.got(Route::kAlongRailBack) >= M - 1;
    return all && t.seg.sendsInFlight == 0 && t.seg.pendingReads == 0 ? Next::kDone : Next::kWait;
  }

  std::optional<Landing> landing(const Turn& t, Route route, int from, int piece) const override {
    if (route == Route::kWithinMachineBack || route == Route::kAlongRailBack) {
      return Landing{Range{0, 0}, nullptr};
    }
    return std::nullopt;
  }

  int piecesPer(Route route) const override {
    return route == Route::kWithinMachineBack || route == Route::kAlongRailBack ? 1 : 0;
  }
  int64_t toEachLocalPeer() const override {
    return 0;
  }
  int64_t toRail() const override {
    return 0;
  }
  bool staged() const override {
    return false;
  }
  bool activatesInOrder() const override {
    return false;
  }
  std::string label(Route route) const override {
    return "announcement of a call handed to Gloo";
  }

  void record(const Operation& op, const Slice& slice, const Segment& seg, int64_t tDone, const Span& span)
      const override {
    span("announcement", slice.tActive, tDone, true);
  }
};

} // namespace

std::unique_ptr<KindSteps> announceSteps(const RankLayout& layout) {
  return std::make_unique<AnnounceSteps>(layout);
}

} // namespace fairring
