#pragma once

#ifdef FAIRRING_WITH_CUDA

#include "backend/future_work.h"

namespace fairring {

// The Work of a CUDA allreduce. Its future completes once the result is
// final on the GPU (the engine learns that from the stream itself), and it is
// created with the tensors' device, so Future.wait() and .then() callbacks
// (DDP's comm hooks) order the caller's streams after it.
//
// wait() without a timeout does not block the host, as with NCCL: it makes the
// caller's current stream wait until the future completes (torch's stream
// baton, Work::blockCurrentStream). An error then surfaces through the future
// and at the next call on the process group. wait(timeout) blocks the host.
class CudaFutureWork : public FutureWork {
 public:
  using FutureWork::FutureWork;

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
};

} // namespace fairring

#endif // FAIRRING_WITH_CUDA
