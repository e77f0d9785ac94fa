#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace fairring {

// One thread that runs reductions and completions, so that neither the
// caller's thread nor a connection's thread ever does arithmetic.
class TaskQueue {
 public:
  TaskQueue();
  ~TaskQueue();

  void post(std::function<void()> task);
  // Runs what is queued, then stops the thread. Idempotent.
  void stop();

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_{false};
  std::thread thread_;
};

} // namespace fairring
