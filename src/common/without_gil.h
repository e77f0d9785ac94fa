#pragma once

#include <Python.h>

namespace fairring {

// Releases the GIL for its scope where this thread holds it. Torch may drop
// the last reference to a backend from Python (a group garbage-collected, a
// local variable going out of scope) and so destroy it holding the GIL; the
// Gloo groups fairring owns join their worker threads when destroyed, and a
// worker may be waiting for the GIL to run a Python callback of a future it
// completes. Nothing that waits may run under the GIL.
class WithoutGil {
 public:
  WithoutGil() : state_(Py_IsInitialized() != 0 && PyGILState_Check() != 0 ? PyEval_SaveThread() : nullptr) {}
  ~WithoutGil() {
    if (state_ != nullptr) {
      PyEval_RestoreThread(state_);
    }
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* state_;
};

} // namespace fairring
