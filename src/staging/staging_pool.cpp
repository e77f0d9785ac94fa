#include "staging/staging_pool.h"

#include <new>
#include <stdexcept>
#include <string>

namespace fairring {

namespace {
constexpr size_t kAlign = 64;
} // namespace

StagingPool::StagingPool(size_t totalBytes, size_t slotBytes) : slotBytes_(slotBytes) {
  if (slotBytes_ == 0) {
    // One machine with one rank reduces nothing; slots carry no memory.
    numSlots_ = 1024;
  } else {
    numSlots_ = totalBytes / slotBytes_;
    if (numSlots_ == 0) {
      throw std::invalid_argument(
          "fairring: FAIRRING_TOTAL_MEMORY=" + std::to_string(totalBytes) +
          " cannot hold one staging slot of " + std::to_string(slotBytes_) + " bytes");
    }
    memory_.reset(new (std::nothrow) uint8_t[numSlots_ * slotBytes_ + kAlign]);
    if (!memory_) {
      throw std::invalid_argument(
          "fairring: cannot allocate FAIRRING_TOTAL_MEMORY=" + std::to_string(totalBytes) +
          " bytes of staging memory on this machine; set a smaller FAIRRING_TOTAL_MEMORY");
    }
  }
  for (size_t i = numSlots_; i > 0; --i) {
    free_.push_back(static_cast<int>(i - 1));
  }
}

int StagingPool::tryAcquire() {
  if (free_.empty()) {
    return -1;
  }
  const int slot = free_.back();
  free_.pop_back();
  return slot;
}

void StagingPool::release(int slot) {
  free_.push_back(slot);
}

uint8_t* StagingPool::data(int slot) {
  if (!memory_) {
    return nullptr;
  }
  auto base = reinterpret_cast<uintptr_t>(memory_.get());
  base = (base + kAlign - 1) / kAlign * kAlign;
  return reinterpret_cast<uint8_t*>(base) + static_cast<size_t>(slot) * slotBytes_;
}

} // namespace fairring
