// The transitions of an operation, a slice and a segment (operation.h), and
// the names the transition check reports.

#include "pipeline/operation.h"

namespace fairring {

bool allowedMove(SegmentState from, SegmentState to) {
  switch (from) {
    case SegmentState::kWaiting: return to == SegmentState::kStepping; // its slice activates
    case SegmentState::kStepping: return to == SegmentState::kReducing || to == SegmentState::kDone;
    case SegmentState::kReducing: return to == SegmentState::kStepping; // the reduction returned
    case SegmentState::kDone: return false;
  }
  return false;
}

const char* stateName(SegmentState s) {
  switch (s) {
    case SegmentState::kWaiting: return "segment waiting";
    case SegmentState::kStepping: return "segment stepping";
    case SegmentState::kReducing: return "segment reducing";
    case SegmentState::kDone: return "segment done";
  }
  return "segment ?";
}

bool allowedMove(SliceState from, SliceState to) {
  switch (from) {
    case SliceState::kWaitingForSlot: return to == SliceState::kStaged || to == SliceState::kActive;
    case SliceState::kStaged: return to == SliceState::kActive; // its slot given back
    case SliceState::kActive: return to == SliceState::kDone;
    case SliceState::kDone: return false;
  }
  return false;
}

const char* stateName(SliceState s) {
  switch (s) {
    case SliceState::kWaitingForSlot: return "slice waiting for a slot";
    case SliceState::kStaged: return "slice staged";
    case SliceState::kActive: return "slice active";
    case SliceState::kDone: return "slice done";
  }
  return "slice ?";
}

bool allowedMove(OpState from, OpState to) {
  return from == OpState::kPosted && (to == OpState::kFinished || to == OpState::kFailed);
}

const char* stateName(OpState s) {
  switch (s) {
    case OpState::kPosted: return "operation posted";
    case OpState::kFinished: return "operation finished";
    case OpState::kFailed: return "operation failed";
  }
  return "operation ?";
}

} // namespace fairring
