#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace fairring {

// A half-open range of addresses, [begin, end).
struct ByteRange {
  uintptr_t begin{0};
  uintptr_t end{0};
};

// The bytes `t`'s elements occupy, from its first element to one past its
// last: a strided view's gaps count as its own (never too little, sometimes
// too much), and an empty or undefined tensor occupies nothing.
std::vector<ByteRange> byteRangesOf(const std::vector<at::Tensor>& tensors);
bool overlap(const std::vector<ByteRange>& a, const std::vector<ByteRange>& b);

// The operations a process group has issued that the device may not have
// finished, each with the bytes it touches and the mark of its end
// (`Done`: the core's std::shared_ptr<c10::Event>, a test's stand-in).
// NCCL runs one group's operations one after the other on one stream, so two
// that touch the same memory never race; the sub-group path runs them on
// several lanes at once, and this is what puts the second after the first
// where their byte ranges meet. Views of one buffer that do not meet (a
// gradient buffer cut into buckets, FSDP's flat parameters) stay in parallel.
//
// Nothing here asks the device anything: `forget` is given the question, so
// that a caller under CUDA graph capture, where asking would break the
// capture, can skip it.
template <typename Done>
class InFlightOps {
 public:
  // Forgets, oldest first, the operations whose end `reached(done)` says the
  // device has passed, stopping at the first that may still run (lanes end
  // out of order: a later one is forgotten once those before it are).
  template <typename Reached>
  void forget(Reached&& reached) {
    while (!ops_.empty() && reached(ops_.front().done)) {
      ops_.pop_front();
    }
  }

  // The ends of the operations in flight whose bytes meet `ranges`.
  std::vector<Done> overlapping(const std::vector<ByteRange>& ranges) const {
    std::vector<Done> found;
    for (const Op& op : ops_) {
      if (overlap(op.ranges, ranges)) {
        found.push_back(op.done);
      }
    }
    return found;
  }

  void add(std::vector<ByteRange> ranges, Done done) {
    ops_.push_back(Op{std::move(ranges), std::move(done)});
  }

  // The ends of every operation that may still run.
  std::vector<Done> all() const {
    std::vector<Done> ends;
    for (const Op& op : ops_) {
      ends.push_back(op.done);
    }
    return ends;
  }

  size_t size() const {
    return ops_.size();
  }

 private:
  struct Op {
    std::vector<ByteRange> ranges;
    Done done;
  };
  std::deque<Op> ops_;
};

} // namespace fairring
