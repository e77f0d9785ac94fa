#pragma once

// Host notification when a CUDA stream reaches a point. Compiled only against a
// CUDA build of torch (fairring_pg/_build.py defines FAIRRING_WITH_CUDA).
#ifdef FAIRRING_WITH_CUDA

#include <c10/cuda/CUDAStream.h>

#include <functional>

#include "common/status.h"

namespace fairring {

// Runs `fn` on CUDA's own callback thread once every operation enqueued on
// `stream` before this call has finished. The pipeline uses it to learn that
// bytes have reached pinned memory (so the network may read them) or that a
// slice is finished on the GPU (so its staging may be reused).
//
// CUDA forbids CUDA calls inside `fn`, and `fn` stalls the stream while it runs:
// it must only update state and post work elsewhere. It must not drop the last
// reference to a tensor or an event either (their destructors call CUDA).
Status notifyWhenReached(const c10::cuda::CUDAStream& stream, std::function<void()> fn);

} // namespace fairring

#endif // FAIRRING_WITH_CUDA
