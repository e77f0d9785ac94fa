#include "faults/fault_points.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace fairring::faults {

namespace detail {
std::atomic<int> gArmed{0};
} // namespace detail

namespace {

struct Armed {
  Fault fault;
  int left;
  int64_t key;
};

std::mutex gMu;
std::map<std::string, std::vector<Armed>>& armed() {
  static auto* points = new std::map<std::string, std::vector<Armed>>(); // used at exit
  return *points;
}
std::map<std::string, int>& counts() {
  static auto* used = new std::map<std::string, int>();
  return *used;
}
std::map<std::string, double>& lastUses() {
  static auto* at = new std::map<std::string, double>();
  return *at;
}

} // namespace

std::optional<Fault> detail::take(const char* point, int64_t key) {
  std::lock_guard<std::mutex> lock(gMu);
  auto it = armed().find(point);
  if (it == armed().end()) {
    return std::nullopt;
  }
  for (auto a = it->second.begin(); a != it->second.end(); ++a) {
    if (a->key != -1 && a->key != key) {
      continue;
    }
    const Fault fault = a->fault;
    ++counts()[point];
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    lastUses()[point] = std::chrono::duration<double>(now).count();
    if (--a->left == 0) {
      it->second.erase(a);
      gArmed.fetch_sub(1, std::memory_order_relaxed);
    }
    return fault;
  }
  return std::nullopt;
}

bool hit(const char* point, int64_t key) {
  const std::optional<Fault> fault = at(point, key);
  if (!fault) {
    return false;
  }
  switch (fault->action) {
    case Action::kDelay:
      std::this_thread::sleep_for(fault->delay);
      return false;
    case Action::kThrow:
      throw std::runtime_error(std::string("fault point ") + point + " (armed by a test)");
    case Action::kClose:
      return true;
  }
  return false;
}

void arm(const std::string& point, Action action, std::chrono::milliseconds delay, int times, int64_t key) {
  if (std::find(kPoints.begin(), kPoints.end(), point) == kPoints.end()) {
    std::string known;
    for (std::string_view name : kPoints) {
      known += (known.empty() ? "" : ", ") + std::string(name);
    }
    throw std::invalid_argument("no fault point is named '" + point + "' (the core has " + known + ")");
  }
  if (times <= 0) {
    throw std::invalid_argument("fault point " + point + ": times must be positive");
  }
  std::lock_guard<std::mutex> lock(gMu);
  armed()[point].push_back(Armed{Fault{action, delay}, times, key});
  detail::gArmed.fetch_add(1, std::memory_order_relaxed);
}

void disarmAll() {
  std::lock_guard<std::mutex> lock(gMu);
  for (const auto& [point, list] : armed()) {
    detail::gArmed.fetch_sub(static_cast<int>(list.size()), std::memory_order_relaxed);
  }
  armed().clear();
}

int uses(const std::string& point) {
  std::lock_guard<std::mutex> lock(gMu);
  auto it = counts().find(point);
  return it == counts().end() ? 0 : it->second;
}

double lastUse(const std::string& point) {
  std::lock_guard<std::mutex> lock(gMu);
  auto it = lastUses().find(point);
  return it == lastUses().end() ? 0.0 : it->second;
}

} // namespace fairring::faults
