#include "subgroups/capture_probe.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <dlfcn.h>

namespace fairring {

namespace {

// From cuda.h (CUresult, CUstreamCaptureStatus), which this file does not include.
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorStreamCaptureImplicit = 906;
constexpr int kCaptureStatusNone = 0;
constexpr int kCaptureStatusActive = 1;
constexpr int kCaptureStatusInvalidated = 2;

} // namespace

CaptureState captureStateFrom(int result, int status) {
  if (result == kCudaErrorStreamCaptureImplicit) {
    return CaptureState::kImplicit;
  }
  if (result != kCudaSuccess) {
    return CaptureState::kUnknown;
  }
  switch (status) {
    case kCaptureStatusNone:
      return CaptureState::kNone;
    case kCaptureStatusActive:
      return CaptureState::kActive;
    case kCaptureStatusInvalidated:
      return CaptureState::kInvalidated;
    default:
      return CaptureState::kUnknown;
  }
}

bool isCapturing(CaptureState state) {
  return state == CaptureState::kActive || state == CaptureState::kInvalidated || state == CaptureState::kImplicit;
}

const char* captureStateName(CaptureState state) {
  switch (state) {
    case CaptureState::kNone:
      return "none";
    case CaptureState::kActive:
      return "active";
    case CaptureState::kInvalidated:
      return "invalidated";
    case CaptureState::kImplicit:
      return "implicit";
    case CaptureState::kUnknown:
      return "unknown";
  }
  return "unknown";
}

CaptureProbe::CaptureProbe(const std::string& library) : library_(library) {
  // Where CUDA tensors exist the runtime has loaded the driver already, and
  // this only takes another reference to it.
  void* handle = dlopen(library.c_str(), RTLD_LAZY | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    lookupError_ = why != nullptr ? why : "dlopen failed";
    return;
  }
  isCapturing_ = reinterpret_cast<IsCapturing>(dlsym(handle, "cuStreamIsCapturing"));
  if (isCapturing_ == nullptr) {
    const char* why = dlerror();
    lookupError_ = why != nullptr ? why : "no cuStreamIsCapturing";
  }
}

CaptureState CaptureProbe::state(void* stream) {
  std::string problem;
  CaptureState state = CaptureState::kUnknown;
  if (isCapturing_ == nullptr) {
    problem = "cuStreamIsCapturing could not be found in " + library_ + " (" + lookupError_ + ")";
  } else {
    int status = 0;
    const int result = isCapturing_(stream, &status);
    state = captureStateFrom(result, status);
    if (state == CaptureState::kUnknown) {
      problem = "cuStreamIsCapturing answered " + std::to_string(result) + " (status " + std::to_string(status) + ")";
    }
  }
  if (state == CaptureState::kUnknown) {
    std::call_once(warned_, [&] {
      TORCH_WARN(
          "fairring: cannot tell whether a stream is being captured into a CUDA graph: ", problem,
          ". Under capture, an allreduce will not be refused here (the capture fails later, obscurely) and a "
          "collective handed to NCCL will wait for fairring's earlier allreduces (which breaks the capture).");
    });
  }
  return state;
}

CaptureState currentStreamCapture(c10::Device device) {
  if (device.type() != c10::DeviceType::CUDA) {
    return CaptureState::kNone;
  }
  static CaptureProbe probe("libcuda.so.1");
  c10::impl::VirtualGuardImpl impl(device.type());
  return probe.state(impl.getStream(device).native_handle());
}

} // namespace fairring
