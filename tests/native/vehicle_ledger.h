#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace vehicle {

// What the host and each stream of the stream vehicle are known to have
// finished: per stream, how many of its launches. A launch on stream s may run
// at any moment after it is issued, unless a clock says otherwise: only what
// the clocks order is ordered (vector clocks, as race detectors keep them).
struct Clock {
  std::vector<uint64_t> ticks; // by stream slot

  uint64_t at(size_t slot) const {
    return slot < ticks.size() ? ticks[slot] : 0;
  }
  void set(size_t slot, uint64_t tick);
  void join(const Clock& other);
  // Every launch `other` knows of is known here too.
  bool covers(const Clock& other) const;
};

// A byte range a launch touches.
struct Touch {
  uintptr_t begin{0};
  uintptr_t end{0};
  bool write{false};
  std::string what; // "tensor of 64 float32 at 0x..." for messages
};

struct LaunchRecord {
  uint64_t id{0};
  int64_t stream{0};
  std::string op;
  uint64_t tick{0}; // the launch's position on its stream
  Clock clock; // what it was ordered after
  std::vector<Touch> touches;
};

// The happens-before record of one process's vehicle device: every launch,
// every event recorded and waited for, every host synchronisation, and the
// shadow state of device memory (per byte range, its last writer and the
// readers since). A launch that touches bytes whose last writer (or, for a
// write, any reader since) is not ordered before it is a race, and so is a
// block freed while a stream the allocator was not told about may still use
// it. Races are recorded, not thrown: the code under test runs on, and the
// test reads them.
class Ledger {
 public:
  static Ledger& get();

  void nameStream(int64_t stream, const std::string& name);
  std::string streamName(int64_t stream);

  uint64_t launch(int64_t stream, const std::string& op, std::vector<Touch> touches);
  Clock clockOf(int64_t stream);
  void wait(int64_t stream, const Clock& event);
  // The host learned that the device got at least this far.
  void hostKnows(const Clock& clock);
  void hostKnowsStream(int64_t stream);
  void hostKnowsAll();
  // Whether the host already knows the device got this far (asks nothing:
  // a watchdog that has seen the end; the host learns nothing from it).
  bool hostKnowsDone(const Clock& clock);
  // Whether an event query says "done". The device is slow but finite: an
  // event the host does not know to be done answers "not yet" to its first
  // `patience` questions (`asked` counts them) and "done" after, and then the
  // host knows. So polling ends, deterministically in program order, and an
  // operation's event is still pending when the next few operations ask.
  bool reached(const Clock& clock, int& asked);
  void setPatience(int patience);
  // The device finishes everything issued; later questions say "done" at once.
  void setIdle(bool idle);

  // A block of device memory goes back to the allocator, which may hand it to
  // a later allocation on `allocStream` at once and waits for the current
  // point of every stream in `recordedOn` before handing it out elsewhere.
  void released(uintptr_t begin, uintptr_t end, int64_t allocStream, const std::set<int64_t>& recordedOn);

  std::vector<std::string> races();
  void clearRaces();
  std::vector<LaunchRecord> launches();
  bool happensBefore(uint64_t first, uint64_t second);
  // Forget everything (launches, shadow memory, races, clocks): between tests.
  void reset();

 private:
  struct Access {
    size_t slot{0};
    uint64_t tick{0};
    uint64_t launch{0};
  };
  struct Cell {
    uintptr_t end{0};
    std::optional<Access> write;
    std::vector<Access> reads; // the latest per stream
  };

  size_t slotLocked(int64_t stream);
  Clock& clockLocked(int64_t stream);
  void split(uintptr_t at);
  void touchLocked(const Touch& touch, const Access& access, const Clock& clock);
  void checkLocked(
      const Access& earlier,
      const char* earlierKind,
      const Access& later,
      const Clock& clock,
      const Touch& touch);
  std::string describe(uint64_t launch);
  void raceLocked(std::string message);

  std::mutex mu_;
  std::map<int64_t, size_t> slots_;
  std::vector<int64_t> streamOfSlot_;
  std::map<int64_t, std::string> names_;
  std::vector<Clock> clocks_; // by slot
  Clock host_;
  bool idle_{false};
  int patience_{8};
  std::map<uintptr_t, Cell> cells_; // by begin; disjoint
  std::vector<LaunchRecord> launches_; // by id - 1
  std::vector<std::string> races_;
  std::set<std::pair<uint64_t, uint64_t>> reported_;
};

} // namespace vehicle
