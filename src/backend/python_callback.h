#pragma once

namespace fairring {

// Whether the calling thread is running the Python callback of a torch Future
// (attached with then() or add_done_callback()). A callback attached to a
// future that is already complete runs at once on the attaching thread (c10's
// rule), so whether a hook's callback runs on a completion thread or inline
// on the training thread depends on timing, and differs between ranks;
// allreduces it issues must go to the same pipeline either way
// (docs/design.md, "Completion order and comm hooks"). fairring_pg's
// future_callbacks module wraps every such callback in enter/exit below; the
// mark is per thread, so reading it needs neither the GIL nor the stack.
bool insidePythonFutureCallback();

// Around one callback, on the thread that runs it; they nest.
void enterPythonFutureCallback();
void exitPythonFutureCallback();

} // namespace fairring
