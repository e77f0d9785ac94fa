#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace fairring {

// A fixed pool of staging memory cut into equal slots (of the size
// fairring_pg.sizing.staging_slot_bytes gives: the engine checks that a slice
// of every dtype fits, SliceCuts::stagedBytes). It is allocated once
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
