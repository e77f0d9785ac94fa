#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

namespace fairring {

// The operations this process group has issued that the device may not have
// finished, each with the memory it touches and the event that marks its
// end. NCCL runs one group's operations one after the other on one stream,
// so two that touch the same memory never race; the sub-group path runs
// them on several lanes at once, and this is what puts the second after the
// first where they share memory (as whole storages: a view counts as its
// base).
class InFlightOps {
 public:
  struct Span {
    uintptr_t begin{0};
    uintptr_t end{0};
  };
  using Events = std::vector<std::shared_ptr<c10::Event>>;

  static std::vector<Span> spansOf(const std::vector<at::Tensor>& tensors);

  // The ends of the operations in flight that touch any of `spans`; first
  // forgets those the device has passed.
  Events overlapping(const std::vector<Span>& spans);
  void add(std::vector<Span> spans, std::shared_ptr<c10::Event> done);
  // The ends of every operation that may still run (lanes finish out of
  // order: the last one issued may end first).
  Events all() const;

 private:
  struct Op {
    std::vector<Span> spans;
    std::shared_ptr<c10::Event> done;
  };
  std::deque<Op> ops_;
};

} // namespace fairring
