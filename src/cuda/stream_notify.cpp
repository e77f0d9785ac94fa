#ifdef FAIRRING_WITH_CUDA

#include "cuda/stream_notify.h"

#include <cuda_runtime_api.h>

#include <iostream>
#include <memory>
#include <string>

namespace fairring {

namespace {

void CUDART_CB trampoline(void* raw) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(raw));
  try {
    (*fn)();
  } catch (const std::exception& e) {
    // Nothing above us can catch it: an exception escaping here would terminate.
    std::cerr << "fairring: a CUDA stream notification failed: " << e.what() << std::endl;
  }
}

} // namespace

Status notifyWhenReached(const c10::cuda::CUDAStream& stream, std::function<void()> fn) {
  auto heap = std::make_unique<std::function<void()>>(std::move(fn));
  const cudaError_t err = cudaLaunchHostFunc(stream.stream(), &trampoline, heap.get());
  if (err != cudaSuccess) {
    return Status::error(std::string("fairring: cudaLaunchHostFunc failed: ") + cudaGetErrorString(err));
  }
  heap.release(); // the trampoline owns it now
  return Status();
}

} // namespace fairring

#endif // FAIRRING_WITH_CUDA
