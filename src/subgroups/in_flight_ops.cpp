#include "subgroups/in_flight_ops.h"

#include <algorithm>

namespace fairring {

std::vector<ByteRange> byteRangesOf(const std::vector<at::Tensor>& tensors) {
  std::vector<ByteRange> ranges;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage() || t.numel() == 0) {
      continue;
    }
    // Strides are never negative in torch: the first element is the lowest
    // address and the element at (size - 1) along every dimension the highest.
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) {
      last += (t.size(d) - 1) * t.stride(d);
    }
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    const auto elem = static_cast<uintptr_t>(t.element_size());
    ranges.push_back(ByteRange{begin, begin + (static_cast<uintptr_t>(last) + 1) * elem});
  }
  return ranges;
}

bool overlap(const std::vector<ByteRange>& a, const std::vector<ByteRange>& b) {
  return std::any_of(a.begin(), a.end(), [&](const ByteRange& x) {
    return std::any_of(b.begin(), b.end(), [&](const ByteRange& y) { return x.begin < y.end && y.begin < x.end; });
  });
}

} // namespace fairring
