#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <memory>

namespace fairring::ring_reaper {

// The Gloo group of the ring after the group's failure gave up on a call it
// still runs ("abandoned"): destroying it joins the thread that runs that
// call, which waits for a dead peer until Gloo's own timeout. Destroy does not
// wait; the group is freed on a thread of its own ("fairring-reap") once
// `inGloo` reaches 0, or left to the process if the interpreter exits first
// (freeing it then would drop tensors Python owns after Python is gone).
void freeWhenIdle(c10::intrusive_ptr<c10d::Backend> ring, std::shared_ptr<const std::atomic<int>> inGloo);

// At interpreter exit (fairring_pg's atexit hook), before finalization.
void processExiting();

} // namespace fairring::ring_reaper
