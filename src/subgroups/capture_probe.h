#pragma once

#include <c10/core/Device.h>

#include <mutex>
#include <string>

namespace fairring {

// Whether a stream is being captured into a CUDA graph, as the CUDA driver's
// cuStreamIsCapturing says. torch's device-generic stream interface cannot
// ask, and this file needs no CUDA headers: the driver is looked up at run
// time.
enum class CaptureState {
  kNone, // not capturing
  kActive, // captured
  kInvalidated, // was captured, and the capture is already broken
  kImplicit, // the legacy default stream while another stream is captured
  kUnknown, // the driver could not say (missing, or an error)
};

// What cuStreamIsCapturing's CUresult and CUstreamCaptureStatus say.
CaptureState captureStateFrom(int result, int status);
// Anything but kNone and kUnknown: work issued there would join a capture,
// or break it.
bool isCapturing(CaptureState state);
const char* captureStateName(CaptureState state);

// cuStreamIsCapturing from `library`, looked up once. Where it cannot be
// found, or answers with an error, every question is answered kUnknown and
// the first such answer is said once (a warning), so that a capture fairring
// cannot see is not silently treated as no capture.
class CaptureProbe {
 public:
  explicit CaptureProbe(const std::string& library);

  CaptureState state(void* stream);

 private:
  using IsCapturing = int (*)(void*, int*);
  IsCapturing isCapturing_{nullptr};
  std::string library_;
  std::string lookupError_;
  std::once_flag warned_;
};

// The state of the caller's current stream on `device` (kNone off CUDA).
CaptureState currentStreamCapture(c10::Device device);

} // namespace fairring
