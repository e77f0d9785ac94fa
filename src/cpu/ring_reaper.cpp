#include "cpu/ring_reaper.h"

#include <pthread.h>

#include <chrono>
#include <thread>

namespace fairring::ring_reaper {

namespace {
std::atomic<bool> gExiting{false};
constexpr auto kPoll = std::chrono::milliseconds(50);
} // namespace

void freeWhenIdle(c10::intrusive_ptr<c10d::Backend> ring, std::shared_ptr<const std::atomic<int>> inGloo) {
  std::thread([ring = std::move(ring), inGloo = std::move(inGloo)]() mutable {
    pthread_setname_np(pthread_self(), "fairring-reap");
    while (inGloo->load() > 0 && !gExiting.load()) {
      std::this_thread::sleep_for(kPoll);
    }
    if (gExiting.load()) {
      (void)ring.release();
      return;
    }
    ring.reset(); // Gloo's calls have ended: its threads join at once
  }).detach();
}

void processExiting() {
  gExiting = true;
}

} // namespace fairring::ring_reaper
