#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace fairring {

// The bytes a slice needs to receive what it reduces: the chunks of the other
// L-1 local ranks, then the shards of the other M-1 machines. Sized for the
// worst dtype so one slot fits any slice. Must match config.staging_slot_bytes.
size_t stagingSlotBytes(size_t sliceBytes, int localSize, int numMachines);

// A fixed pool of staging memory cut into equal slots. It is allocated once
// and never grows: when every slot is taken, work waits for one (the caller
// keeps the queue; this class is not thread-safe and lives under its lock).
class StagingPool {
 public:
  StagingPool(size_t totalBytes, size_t slotBytes);

  size_t numSlots() const { return numSlots_; }
  size_t slotBytes() const { return slotBytes_; }
  size_t freeSlots() const { return free_.size(); }

  // Returns a slot index, or -1 if none is free.
  int tryAcquire();
  void release(int slot);
  uint8_t* data(int slot);

 private:
  size_t slotBytes_;
  size_t numSlots_;
  std::unique_ptr<uint8_t[]> memory_;
  std::vector<int> free_;
};

} // namespace fairring
