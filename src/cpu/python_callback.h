#pragma once

#include <ATen/core/ivalue.h>

namespace fairring {

// Whether the calling thread is running the Python callback of a torch Future
// (attached with then() or add_done_callback()). A callback attached to a
// future that is already complete runs at once on the attaching thread (c10's
// rule), so whether a hook's callback runs on a completion thread or inline
// on the training thread depends on timing, and differs between ranks;
// allreduces it issues must go to the same pipeline either way
// (docs/design.md, "Completion order and comm hooks"). fairring_pg's
// future_callbacks module wraps the callbacks of fairring's futures (and of
// the futures made from them in Python) in enter/exit below; the mark is per
// thread, so reading it needs neither the GIL nor the stack.
bool insidePythonFutureCallback();

// Around one callback, on the thread that runs it; they nest.
void enterPythonFutureCallback();
void exitPythonFutureCallback();

// The futures whose Python callbacks count: those fairring hands out, and
// those made from them (then(), collect_all()). A callback of any other
// future (RPC's, a checkpointer's, a user's) is none of fairring's business:
// the collectives it issues are the program's own, in its order, as on Gloo.
// The registry holds weak references, so an entry never keeps a future alive
// and its address is not reused while it is listed.
void adoptFuture(const c10::intrusive_ptr<c10::ivalue::Future>& future);
bool isAdoptedFuture(const c10::ivalue::Future* future);

} // namespace fairring
