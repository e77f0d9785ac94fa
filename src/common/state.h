#pragma once

// One state value and the moves allowed out of it. A state enum names its
// states; next to it, `allowedMove(from, to)` lists the transitions and
// `stateName(s)` names them for the check's message (found by argument-
// dependent lookup). moveTo() refuses any other transition, so a state is
// only ever reached the way the code says.

#include <c10/util/Exception.h>

namespace fairring {

template <typename S>
class StateValue {
 public:
  explicit StateValue(S initial) : now_(initial) {}

  S get() const {
    return now_;
  }
  bool is(S s) const {
    return now_ == s;
  }
  void moveTo(S next) {
    TORCH_INTERNAL_ASSERT(
        allowedMove(now_, next), "fairring: internal error: no transition from ", stateName(now_), " to ",
        stateName(next));
    now_ = next;
  }

 private:
  S now_;
};

} // namespace fairring
