#include "backend/python_callback.h"

namespace fairring {

namespace {

// Callbacks this thread is inside: a callback may attach another to a
// completed future, which then runs nested in it.
thread_local int tlDepth = 0;

} // namespace

bool insidePythonFutureCallback() {
  return tlDepth > 0;
}

void enterPythonFutureCallback() {
  ++tlDepth;
}

void exitPythonFutureCallback() {
  if (tlDepth > 0) {
    --tlDepth;
  }
}

} // namespace fairring
