#pragma once

namespace fairring {

// Whether the calling thread is running the callback of a torch Future that
// Python code attached with then() or add_done_callback(): some Python frame
// on this thread's stack has a torch.futures.Future among its positional
// arguments. A callback attached to a future that is already complete runs
// at once on the attaching thread (c10's rule), so whether a hook's callback
// runs on a completion thread or inline on the training thread depends on
// timing, and differs between ranks; allreduces it issues must go to the
// same pipeline either way (docs/design.md, "Completion order and comm
// hooks"). False without an interpreter.
bool insidePythonFutureCallback();

} // namespace fairring
