#include "measured/agreement.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "faults/plants.h"

namespace fairring {

namespace {

// A value: "timed <s0> <s1>" (hexadecimal floats: exact), "untimed <why>" or
// "failed <why>".
constexpr const char* kTimed = "timed ";
constexpr const char* kUntimed = "untimed ";
constexpr const char* kFailed = "failed ";

std::string encode(const std::optional<RankFigures>& mine, const std::string& failure) {
  if (!mine) {
    return kFailed + failure;
  }
  if (!mine->cannotTime.empty()) {
    return kUntimed + mine->cannotTime;
  }
  char text[96];
  std::snprintf(text, sizeof(text), "%s%a %a", kTimed, mine->seconds[0], mine->seconds[1]);
  return text;
}

bool startsWith(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

std::vector<uint8_t> bytesOf(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

// Reading the others: the first polls come soon (the ranks usually arrive
// together), later ones every 10 ms, so a stop ends the wait within that.
constexpr std::chrono::microseconds kFirstPoll{100};
constexpr std::chrono::microseconds kLongestPoll{10000};

} // namespace

Agreement::Agreement(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string device)
    : store_(std::move(store)), rank_(rank), size_(size), device_(std::move(device)) {}

std::string Agreement::name(size_t fromBytes) const {
  if (plants::planted(plants::Plant::kAgreementByOrder)) {
    // Tests: the n-th agreement of this process pairs with the others' n-th,
    // whichever device and class each is (as calls on one group pair).
    static std::atomic<int> order{0};
    return "order/" + std::to_string(order++);
  }
  return device_ + "/" + std::to_string(fromBytes);
}

std::string Agreement::key(const std::string& name, int rank) {
  return name + "/" + std::to_string(rank);
}

void Agreement::tell(const std::string& name, const std::string& failure) const {
  try {
    store_->set(key(name, rank_), bytesOf(encode(std::nullopt, failure)));
  } catch (const std::exception&) {
    // The store is what failed: the others reach the timeout instead.
  }
}

Agreed Agreement::combine(
    size_t fromBytes,
    const std::optional<RankFigures>& mine,
    const std::string& failure,
    std::chrono::steady_clock::time_point deadline,
    const Stop& stop) const {
  Agreed agreed;
  const std::string name = this->name(fromBytes);
  // Said alike by this rank and by every rank that reads its reason.
  const auto fail = [&](const std::string& why) {
    agreed.failure = "rank " + std::to_string(rank_) + " could not take part: " + why;
    tell(name, why);
    return agreed;
  };
  if (!mine) {
    return fail(failure);
  }
  try {
    store_->set(key(name, rank_), bytesOf(encode(mine, "")));
  } catch (const std::exception& e) {
    return fail(std::string("publishing its figures failed: ") + e.what());
  }
  std::vector<std::optional<std::string>> values(static_cast<size_t>(size_));
  values[static_cast<size_t>(rank_)] = encode(mine, "");
  auto poll = kFirstPoll;
  for (;;) {
    std::vector<int> missing;
    try {
      for (int r = 0; r < size_; ++r) {
        auto& value = values[static_cast<size_t>(r)];
        if (!value && store_->check({key(name, r)})) {
          const std::vector<uint8_t> raw = store_->get(key(name, r));
          value = std::string(raw.begin(), raw.end());
        }
        if (!value) {
          missing.push_back(r);
        } else if (startsWith(*value, kFailed)) {
          // Its reason, as every rank that reads it says it.
          agreed.failure = "rank " + std::to_string(r) + " could not take part: " + value->substr(strlen(kFailed));
          return agreed;
        }
      }
    } catch (const std::exception& e) {
      return fail(std::string("reading the other ranks' figures failed: ") + e.what());
    }
    if (missing.empty()) {
      break;
    }
    if (stop()) {
      return fail("its process group was shut down");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string ranks;
      for (int r : missing) {
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      }
      return fail("rank(s) " + ranks + " did not reach the agreement within the process group's timeout");
    }
    std::this_thread::sleep_for(poll);
    poll = std::min(poll * 2, kLongestPoll);
  }
  return combined(values);
}

Agreed Agreement::combined(const std::vector<std::optional<std::string>>& values) const {
  Agreed agreed;
  // Tests: the fastest rank's times, not the slowest's.
  const bool fastest = plants::planted(plants::Plant::kMeasuredFastestRank);
  bool first = true;
  for (int r = 0; r < size_; ++r) {
    const std::string& value = *values[static_cast<size_t>(r)];
    if (startsWith(value, kUntimed)) {
      if (agreed.cannotTimeRank < 0) {
        agreed.cannotTimeRank = r;
        agreed.cannotTime = value.substr(strlen(kUntimed));
      }
      continue;
    }
    const char* text = value.c_str() + strlen(kTimed);
    char* end = nullptr;
    const double s0 = std::strtod(text, &end);
    const double s1 = std::strtod(end, nullptr);
    const auto combine = [&](double a, double b) { return first ? b : fastest ? std::min(a, b) : std::max(a, b); };
    agreed.seconds[0] = combine(agreed.seconds[0], s0);
    agreed.seconds[1] = combine(agreed.seconds[1], s1);
    first = false;
  }
  return agreed;
}

} // namespace fairring
