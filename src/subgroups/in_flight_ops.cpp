#include "subgroups/in_flight_ops.h"

#include <algorithm>

namespace fairring {

std::vector<InFlightOps::Span> InFlightOps::spansOf(const std::vector<at::Tensor>& tensors) {
  std::vector<Span> spans;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage() || t.storage().nbytes() == 0) {
      continue;
    }
    const auto begin = reinterpret_cast<uintptr_t>(t.storage().data());
    spans.push_back(Span{begin, begin + t.storage().nbytes()});
  }
  return spans;
}

InFlightOps::Events InFlightOps::overlapping(const std::vector<Span>& spans) {
  // Operations end in about the order they were issued: drop from the front.
  while (!ops_.empty() && ops_.front().done->query()) {
    ops_.pop_front();
  }
  Events found;
  for (const Op& op : ops_) {
    const bool touches = std::any_of(op.spans.begin(), op.spans.end(), [&](const Span& a) {
      return std::any_of(spans.begin(), spans.end(), [&](const Span& b) { return a.begin < b.end && b.begin < a.end; });
    });
    if (touches) {
      found.push_back(op.done);
    }
  }
  return found;
}

void InFlightOps::add(std::vector<Span> spans, std::shared_ptr<c10::Event> done) {
  if (done) {
    ops_.push_back(Op{std::move(spans), std::move(done)});
  }
}

InFlightOps::Events InFlightOps::all() const {
  Events events;
  for (const Op& op : ops_) {
    events.push_back(op.done);
  }
  return events;
}

} // namespace fairring
