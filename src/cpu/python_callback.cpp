#include "cpu/python_callback.h"

#include <iterator>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fairring {

namespace {

// Callbacks this thread is inside: a callback may attach another to a
// completed future, which then runs nested in it.
thread_local int tlDepth = 0;

struct Adopted {
  std::mutex mu;
  std::unordered_map<const c10::ivalue::Future*, c10::weak_intrusive_ptr<c10::ivalue::Future>> futures;
  size_t pruneAt{64};
};

Adopted& adopted() {
  static auto* registry = new Adopted(); // never destroyed: callbacks may run at exit
  return *registry;
}

} // namespace

void adoptFuture(const c10::intrusive_ptr<c10::ivalue::Future>& future) {
  using Weak = c10::weak_intrusive_ptr<c10::ivalue::Future>;
  // Dropped after the lock: the last weak reference to a finished future destroys it,
  // and with it the Python callbacks it held, whose release takes the GIL. Under the
  // lock, that waits for a Python thread that may be waiting for the lock in
  // isAdoptedFuture (it holds the GIL there): a deadlock.
  std::vector<Weak> dropped;
  Adopted& a = adopted();
  std::lock_guard<std::mutex> lock(a.mu);
  auto [at, inserted] = a.futures.try_emplace(future.get(), Weak(future));
  if (!inserted) {
    dropped.push_back(std::exchange(at->second, Weak(future)));
  }
  if (a.futures.size() >= a.pruneAt) {
    // Amortised: every future fairring hands out lands here once.
    for (auto it = a.futures.begin(); it != a.futures.end();) {
      if (it->second.expired()) {
        dropped.push_back(std::move(it->second));
        it = a.futures.erase(it);
      } else {
        ++it;
      }
    }
    a.pruneAt = 2 * a.futures.size() + 64;
  }
}

bool isAdoptedFuture(const c10::ivalue::Future* future) {
  Adopted& a = adopted();
  std::lock_guard<std::mutex> lock(a.mu);
  auto it = a.futures.find(future);
  return it != a.futures.end() && !it->second.expired();
}

bool insidePythonFutureCallback() {
  return tlDepth > 0;
}

void enterPythonFutureCallback() {
  ++tlDepth;
}

void exitPythonFutureCallback() {
  if (tlDepth > 0) {
    --tlDepth;
  }
}

} // namespace fairring
