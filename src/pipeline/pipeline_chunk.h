#pragma once

#include <cstddef>

namespace fairring {

// The segment of a slice that the pipeline moves when FAIRRING_PIPELINE_CHUNK
// is not set: measured on 4 × 1 at 1 Gbit/s (docs/design.md, "Pipelining
// inside a slice").
constexpr size_t kDefaultPipelineChunkBytes = 1 << 20;

// FAIRRING_PIPELINE_CHUNK in bytes, else the default. fairring_pg/config.py
// validates the variable (same syntax: 512K, 1M, 1.5K) before any engine is
// made, so this only converts; the backend's options have no field for it.
size_t pipelineChunkBytes();

} // namespace fairring
