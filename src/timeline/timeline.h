#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace fairring {

// Horovod's Timeline for fairring: a Chrome trace (chrome://tracing, Perfetto)
// per rank, with a span per operation and per phase of every slice. When no
// path is set, enabled() is false and callers skip building any event, so it
// costs one branch.
class Timeline {
 public:
  // An empty path disables the timeline.
  Timeline(const std::string& path, int rank);
  ~Timeline();

  bool enabled() const { return file_.load(std::memory_order_relaxed) != nullptr; }

  // Microseconds on the system clock, so that ranks of one host line up when
  // their traces are merged.
  static int64_t now();
  // Sets `at` to now() while enabled: free when off (one branch, no clock read).
  void stamp(int64_t& at) const {
    if (enabled()) {
      at = now();
    }
  }

  // A complete span on a named track ("ops" for operations).
  void span(const std::string& track, const std::string& name, int64_t beginUs, int64_t endUs,
            const std::string& argsJson = "{}");

  // A span on the async track of one slice (Perfetto draws each id on its own
  // row), so that slices in flight at once do not overlap on one row.
  void sliceSpan(uint64_t sliceId, const std::string& name, int64_t beginUs, int64_t endUs,
                 const std::string& argsJson = "{}");

  // Writes what is buffered. Called from the engine's watchdog, off the data path.
  void flush();

  // Writes the rest and ends the JSON array; later events are dropped. Called at
  // shutdown, so that a group destroyed while Python objects still hold it (autograd
  // graphs, DTensor meshes) leaves a complete trace; the destructor closes otherwise.
  void close();

 private:
  void append(const std::string& event);

  std::atomic<std::FILE*> file_{nullptr};
  int rank_;
  std::mutex fileMu_; // file_ against close()
  std::mutex mu_;
  std::string buffer_;
  bool first_{true};
};

} // namespace fairring
