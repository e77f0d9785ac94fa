// What the engine draws on the timeline (timeline/timeline.h): a span per
// operation, and per segment the spans of its kind's steps.

#include "ops/reduce_kind.h"
#include "pipeline/collective_engine.h"

namespace fairring {

void CollectiveEngine::recordSegment(const Operation& op, const Slice& slice, const Segment& seg) {
  if (!timeline_.enabled()) {
    return;
  }
  const int64_t tDone = Timeline::now();
  const std::string elements = op.sliced()
      ? "\"elements\":" + std::to_string(op.cuts.segment(slice.index, seg.index).size())
      : "\"elements_per_rank\":" + std::to_string(op.sharded.segment(slice.index, seg.index).size());
  const std::string args = "{\"op\":" + std::to_string(op.seq) + ",\"slice\":" + std::to_string(slice.index) +
      ",\"segment\":" + std::to_string(seg.index) + "," + elements + "}";
  // A route this shape does not have (no peers on the machine, or one machine) is not drawn.
  stepsOf(op).record(op, slice, seg, tDone, [&](const char* name, int64_t begin, int64_t end, bool shown) {
    if (shown) {
      timeline_.sliceSpan(seg.id, name, begin, end, args);
    }
  });
}

void CollectiveEngine::recordOp(const Operation& op) {
  if (!timeline_.enabled()) {
    return;
  }
  const DataHeader h = op.header(0, 0, Route::kWithinMachine);
  timeline_.span(
      "ops", std::string(opKindName(op.kind)) + " #" + std::to_string(op.seq), op.tEnqueued, Timeline::now(),
      "{\"elements\":" + std::to_string(h.numel) + ",\"dtype\":\"" + dtypeName(op.work.scalar_type()) +
          "\",\"op\":\"" + opName(op.op) + "\",\"slices\":" + std::to_string(op.slices.size()) + "}");
}

} // namespace fairring
