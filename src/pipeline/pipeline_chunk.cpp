#include "pipeline/pipeline_chunk.h"

#include <cctype>
#include <cmath>
#include <cstdlib>

namespace fairring {

size_t pipelineChunkBytes() {
  const char* raw = std::getenv("FAIRRING_PIPELINE_CHUNK");
  if (raw == nullptr) {
    return kDefaultPipelineChunkBytes;
  }
  char* end = nullptr;
  const double number = std::strtod(raw, &end);
  while (std::isspace(static_cast<unsigned char>(*end))) {
    ++end;
  }
  double scale = 1;
  switch (std::tolower(static_cast<unsigned char>(*end))) {
    case 'k':
      scale = 1024.0;
      break;
    case 'm':
      scale = 1024.0 * 1024;
      break;
    case 'g':
      scale = 1024.0 * 1024 * 1024;
      break;
    default:
      break;
  }
  const double bytes = std::round(number * scale);
  // Unreachable after config.py's check; a safe value rather than a crash.
  return bytes >= 1 ? static_cast<size_t>(bytes) : kDefaultPipelineChunkBytes;
}

} // namespace fairring
