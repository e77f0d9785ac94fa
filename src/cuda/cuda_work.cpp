#ifdef FAIRRING_WITH_CUDA

#include "cuda/cuda_work.h"

namespace fairring {

bool CudaFutureWork::wait(std::chrono::milliseconds timeout) {
  auto future = getFuture();
  if (timeout == kNoTimeout && !future->completed()) {
    blockCurrentStream();
    return true;
  }
  FutureWork::wait(timeout); // blocks, throws the error if there is one
  synchronize();
  return true;
}

void CudaFutureWork::synchronize() {
  auto future = getFuture();
  if (future->completed() && !future->hasError()) {
    future->wait(); // completed: only orders the current streams after it
  }
}

} // namespace fairring

#endif // FAIRRING_WITH_CUDA
