#include "failure/group_failure.h"

namespace fairring {

std::optional<uint64_t> GroupFailure::fail(const std::string& message, uint64_t fromSeq) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t before = failSeq_.load(std::memory_order_relaxed);
  if (reason_.empty()) {
    reason_ = message;
  }
  if (fromSeq >= before) {
    return std::nullopt; // those operations have failed already
  }
  failSeq_.store(fromSeq, std::memory_order_release);
  return before;
}

std::string GroupFailure::reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reason_;
}

std::string GroupFailure::refusal() const {
  return reason() + " (this process group failed earlier and cannot be used)";
}

std::optional<std::string> GroupFailure::peerLost(const std::string& message, bool needed) {
  if (needed) {
    return message;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (departed_.empty()) {
    departed_ = message;
  }
  return std::nullopt;
}

std::optional<std::string> GroupFailure::departed() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (departed_.empty()) {
    return std::nullopt;
  }
  return departed_;
}

std::optional<GroupFailure::Abort> GroupFailure::abortDue(bool stopping) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping) {
    return std::nullopt;
  }
  if (!connected_) {
    abortHeld_ = true;
    return std::nullopt;
  }
  return Abort{reason_, failSeq_.load(std::memory_order_relaxed)};
}

std::optional<GroupFailure::Abort> GroupFailure::connected() {
  std::lock_guard<std::mutex> lock(mu_);
  connected_ = true;
  if (!abortHeld_) {
    return std::nullopt;
  }
  abortHeld_ = false;
  return Abort{reason_, failSeq_.load(std::memory_order_relaxed)};
}

uint64_t GroupFailure::abortsQueued(const std::vector<int>& peers, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t round = ++abortRound_;
  for (int peer : peers) {
    untold_[peer] = round;
  }
  abortsQueuedAt_ = now;
  return round;
}

void GroupFailure::abortLeft(int peer, uint64_t round) {
  std::lock_guard<std::mutex> lock(mu_);
  // An earlier round's abort says less (a later turn to fail from): it does not count.
  if (auto it = untold_.find(peer); it != untold_.end() && it->second == round) {
    untold_.erase(it);
  }
}

bool GroupFailure::mayClose(Clock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  return untold_.empty() || now - abortsQueuedAt_ > kAbortGrace;
}

GroupFailure::Clock::time_point GroupFailure::abortsDeadline(Clock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  return untold_.empty() ? now : abortsQueuedAt_ + kAbortGrace;
}

std::string GroupFailure::forwarded(const std::string& reason, const std::string& me, const std::string& peer) {
  return reason + " (reported to " + me + " by " + peer + ")";
}

} // namespace fairring
