#include "vehicle_ledger.h"

#include <algorithm>
#include <sstream>

namespace vehicle {

void Clock::set(size_t slot, uint64_t tick) {
  if (ticks.size() <= slot) {
    ticks.resize(slot + 1, 0);
  }
  ticks[slot] = tick;
}

void Clock::join(const Clock& other) {
  if (ticks.size() < other.ticks.size()) {
    ticks.resize(other.ticks.size(), 0);
  }
  for (size_t i = 0; i < other.ticks.size(); ++i) {
    ticks[i] = std::max(ticks[i], other.ticks[i]);
  }
}

bool Clock::covers(const Clock& other) const {
  for (size_t i = 0; i < other.ticks.size(); ++i) {
    if (at(i) < other.ticks[i]) {
      return false;
    }
  }
  return true;
}

Ledger& Ledger::get() {
  static Ledger* ledger = new Ledger(); // never destroyed: allocations may outlive statics
  return *ledger;
}

size_t Ledger::slotLocked(int64_t stream) {
  auto found = slots_.find(stream);
  if (found != slots_.end()) {
    return found->second;
  }
  const size_t slot = streamOfSlot_.size();
  slots_.emplace(stream, slot);
  streamOfSlot_.push_back(stream);
  clocks_.emplace_back();
  return slot;
}

Clock& Ledger::clockLocked(int64_t stream) {
  return clocks_[slotLocked(stream)];
}

void Ledger::nameStream(int64_t stream, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  names_[stream] = name;
}

std::string Ledger::streamName(int64_t stream) {
  auto found = names_.find(stream);
  std::ostringstream out;
  out << "stream " << stream;
  if (found != names_.end()) {
    out << " (" << found->second << ")";
  }
  return out.str();
}

uint64_t Ledger::launch(int64_t stream, const std::string& op, std::vector<Touch> touches) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t slot = slotLocked(stream);
  Clock& clock = clocks_[slot];
  // A launch cannot start before it is issued: whatever the host knows to be
  // done when it issues it is done before it runs.
  clock.join(host_);
  const uint64_t tick = clock.at(slot) + 1;
  clock.set(slot, tick);
  LaunchRecord record;
  record.id = launches_.size() + 1;
  record.stream = stream;
  record.op = op;
  record.tick = tick;
  record.clock = clock;
  record.touches = std::move(touches);
  const Access access{slot, tick, record.id};
  launches_.push_back(record);
  for (const Touch& touch : record.touches) {
    if (touch.begin < touch.end) {
      touchLocked(touch, access, clock);
    }
  }
  return record.id;
}

Clock Ledger::clockOf(int64_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  return clockLocked(stream);
}

void Ledger::wait(int64_t stream, const Clock& event) {
  std::lock_guard<std::mutex> lock(mu_);
  clockLocked(stream).join(event);
}

void Ledger::hostKnows(const Clock& clock) {
  std::lock_guard<std::mutex> lock(mu_);
  host_.join(clock);
}

void Ledger::hostKnowsStream(int64_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  host_.join(clockLocked(stream));
}

void Ledger::hostKnowsAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Clock& clock : clocks_) {
    host_.join(clock);
  }
}

bool Ledger::hostKnowsDone(const Clock& clock) {
  std::lock_guard<std::mutex> lock(mu_);
  return host_.covers(clock);
}

bool Ledger::reached(const Clock& clock, int& asked) {
  std::lock_guard<std::mutex> lock(mu_);
  if (host_.covers(clock)) {
    return true;
  }
  if (idle_ || ++asked > patience_) {
    host_.join(clock);
    return true;
  }
  return false;
}

void Ledger::setPatience(int patience) {
  std::lock_guard<std::mutex> lock(mu_);
  patience_ = patience;
}

void Ledger::setIdle(bool idle) {
  std::lock_guard<std::mutex> lock(mu_);
  idle_ = idle;
  if (idle) {
    for (const Clock& clock : clocks_) {
      host_.join(clock);
    }
  }
}

void Ledger::split(uintptr_t at) {
  auto it = cells_.upper_bound(at);
  if (it == cells_.begin()) {
    return;
  }
  --it;
  if (it->first < at && at < it->second.end) {
    Cell tail = it->second;
    it->second.end = at;
    cells_.emplace(at, std::move(tail));
  }
}

void Ledger::touchLocked(const Touch& touch, const Access& access, const Clock& clock) {
  split(touch.begin);
  split(touch.end);
  uintptr_t pos = touch.begin;
  auto it = cells_.lower_bound(touch.begin);
  while (pos < touch.end) {
    if (it == cells_.end() || it->first > pos) {
      // Bytes nobody has touched yet: fresh memory.
      const uintptr_t end = (it != cells_.end() && it->first < touch.end) ? it->first : touch.end;
      Cell cell;
      cell.end = end;
      if (touch.write) {
        cell.write = access;
      } else {
        cell.reads.push_back(access);
      }
      it = std::next(cells_.emplace_hint(it, pos, std::move(cell)));
      pos = end;
      continue;
    }
    Cell& cell = it->second;
    if (cell.write) {
      checkLocked(*cell.write, "wrote", access, clock, touch);
    }
    if (touch.write) {
      for (const Access& read : cell.reads) {
        checkLocked(read, "read", access, clock, touch);
      }
      cell.write = access;
      cell.reads.clear();
    } else {
      auto same = std::find_if(
          cell.reads.begin(), cell.reads.end(), [&](const Access& a) { return a.slot == access.slot; });
      if (same != cell.reads.end()) {
        *same = access;
      } else {
        cell.reads.push_back(access);
      }
    }
    pos = cell.end;
    ++it;
  }
}

void Ledger::checkLocked(
    const Access& earlier,
    const char* earlierKind,
    const Access& later,
    const Clock& clock,
    const Touch& touch) {
  if (earlier.slot == later.slot || clock.at(earlier.slot) >= earlier.tick) {
    return;
  }
  if (!reported_.emplace(earlier.launch, later.launch).second) {
    return;
  }
  std::ostringstream out;
  out << describe(later.launch) << (touch.write ? " writes " : " reads ") << touch.what << ", which "
      << describe(earlier.launch) << " " << earlierKind << " them without being ordered before it";
  raceLocked(out.str());
}

std::string Ledger::describe(uint64_t launch) {
  const LaunchRecord& record = launches_.at(launch - 1);
  std::ostringstream out;
  out << "launch #" << record.id << " '" << record.op << "' on " << streamName(record.stream);
  return out.str();
}

void Ledger::raceLocked(std::string message) {
  races_.push_back(std::move(message));
}

void Ledger::released(uintptr_t begin, uintptr_t end, int64_t allocStream, const std::set<int64_t>& recordedOn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (begin >= end) {
    return;
  }
  // The allocator hands the block out again once the device has passed these
  // points; anything touching it that is not before them may run after the
  // next owner starts writing.
  // (and what the host already knows to be done is done).
  Clock safe = clockLocked(allocStream);
  safe.join(host_);
  for (int64_t stream : recordedOn) {
    safe.join(clockLocked(stream));
  }
  split(begin);
  split(end);
  auto it = cells_.lower_bound(begin);
  while (it != cells_.end() && it->first < end) {
    std::vector<Access> uses(it->second.reads);
    if (it->second.write) {
      uses.push_back(*it->second.write);
    }
    for (const Access& use : uses) {
      if (safe.at(use.slot) >= use.tick || !reported_.emplace(use.launch, 0).second) {
        continue;
      }
      std::ostringstream out;
      out << "memory [0x" << std::hex << begin << ", 0x" << end << std::dec << ") allocated on "
          << streamName(allocStream) << " was freed while " << describe(use.launch)
          << " may still use it: the allocator was not told about that stream (record_stream)";
      raceLocked(out.str());
    }
    it = cells_.erase(it);
  }
}

std::vector<std::string> Ledger::races() {
  std::lock_guard<std::mutex> lock(mu_);
  return races_;
}

void Ledger::clearRaces() {
  std::lock_guard<std::mutex> lock(mu_);
  races_.clear();
  reported_.clear();
}

std::vector<LaunchRecord> Ledger::launches() {
  std::lock_guard<std::mutex> lock(mu_);
  return launches_;
}

bool Ledger::happensBefore(uint64_t first, uint64_t second) {
  std::lock_guard<std::mutex> lock(mu_);
  const LaunchRecord& a = launches_.at(first - 1);
  const LaunchRecord& b = launches_.at(second - 1);
  return b.clock.at(slots_.at(a.stream)) >= a.tick;
}

void Ledger::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Clock& clock : clocks_) {
    host_.join(clock);
  }
  cells_.clear();
  races_.clear();
  reported_.clear();
}

} // namespace vehicle
