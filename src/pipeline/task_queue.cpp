#include "pipeline/task_queue.h"

#include <exception>
#include <iostream>

namespace fairring {

TaskQueue::TaskQueue() : thread_([this] { run(); }) {}

TaskQueue::~TaskQueue() {
  stop();
}

void TaskQueue::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void TaskQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
  }
}

void TaskQueue::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) {
        return;
      }
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    // A task reports its own errors (the engine's reductions fail their
    // operation); one that escapes must not end the process.
    try {
      task();
    } catch (const std::exception& e) {
      std::cerr << "fairring: a task of the reduction thread failed: " << e.what() << std::endl;
    } catch (...) {
      std::cerr << "fairring: a task of the reduction thread failed" << std::endl;
    }
  }
}

} // namespace fairring
