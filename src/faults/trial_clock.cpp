#include "faults/trial_clock.h"

#include <map>
#include <mutex>
#include <utility>

namespace fairring::faults {

namespace detail {
std::atomic<int> gTrialClockSet{0};
} // namespace detail

namespace {

std::mutex gMu;
// (way, class start or -1) -> seconds. Leaked: read by threads that may outlive statics at exit.
std::map<std::pair<std::string, int64_t>, double>& table() {
  static auto* entries = new std::map<std::pair<std::string, int64_t>, double>();
  return *entries;
}

} // namespace

std::optional<double> detail::trialSeconds(const std::string& way, size_t fromBytes) {
  std::lock_guard<std::mutex> lock(gMu);
  for (const int64_t key : {static_cast<int64_t>(fromBytes), int64_t{-1}}) {
    auto it = table().find({way, key});
    if (it != table().end()) {
      return it->second;
    }
  }
  return std::nullopt;
}

void setTrialSeconds(const std::string& way, int64_t fromBytes, double seconds) {
  std::lock_guard<std::mutex> lock(gMu);
  table()[{way, fromBytes}] = seconds;
  detail::gTrialClockSet.store(static_cast<int>(table().size()), std::memory_order_relaxed);
}

void clearTrialSeconds() {
  std::lock_guard<std::mutex> lock(gMu);
  table().clear();
  detail::gTrialClockSet.store(0, std::memory_order_relaxed);
}

} // namespace fairring::faults
