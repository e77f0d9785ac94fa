#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <memory>
#include <mutex>

namespace fairring {

// A Work that is a thin face over a Future: the engine completes the future,
// and wait(), isCompleted() and getFuture() (what DDP's comm hooks chain on)
// all read it, so there is one source of truth for done-ness and errors.
class FutureWork : public c10d::Work {
 public:
  FutureWork(
      int rank,
      c10d::OpType opType,
      const char* profilingTitle,
      const std::vector<at::Tensor>& inputs,
      c10::intrusive_ptr<c10::ivalue::Future> future);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  struct Signal {
    std::mutex mu;
    std::condition_variable cv;
    bool done{false};
  };

  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<Signal> signal_;
};

} // namespace fairring
