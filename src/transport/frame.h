#pragma once

#include <cstdint>

namespace fairring {

// What precedes every message on an established connection: the length of
// the header that follows (a DataHeader or an Abort, see wire.h) and of the
// body. A body either follows in the stream, or stays in the sender's memory
// at `bodyAddress` for the receiver to copy out (same machine, see
// memory_reader.h); then the receiver answers with one byte once it has.
struct Frame {
  static constexpr uint32_t kMagic = 0x46524d31; // "FRM1"
  // Headers are a few dozen bytes, aborts a few KiB: anything longer is a
  // broken or hostile stream, not something to allocate for.
  static constexpr uint32_t kMaxHeaderBytes = 64 * 1024;

  uint32_t magic{kMagic};
  uint32_t headerBytes{0};
  uint64_t bodyBytes{0};
  uint64_t bodyAddress{0};
};
static_assert(sizeof(Frame) == 24, "Frame is sent as it is laid out");

} // namespace fairring
