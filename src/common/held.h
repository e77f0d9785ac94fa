#pragma once

#include <c10/util/Exception.h>

#include <mutex>

namespace fairring {

// Proof that the caller holds its owner's lock: made only from a held lock,
// and asked for by every method of a part whose state that lock guards
// (SubgroupAllreduce's CallLedger). A caller without the lock has none to
// give, and the compiler says so.
class Held {
 public:
  explicit Held(const std::unique_lock<std::mutex>& lock) {
    TORCH_INTERNAL_ASSERT(lock.owns_lock(), "fairring: a Held made without its lock");
  }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
};

} // namespace fairring
