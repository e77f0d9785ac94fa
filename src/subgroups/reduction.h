#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstddef>

// How the sub-group path reduces what NCCL (and Gloo) cannot, and what it
// reduces itself: the dtype a tensor travels in, the op a sub-group runs, and
// the reduction kernel of the rail exchange.
namespace fairring {

using RedOp = c10d::ReduceOp::RedOpType;

// NCCL (and Gloo) cannot reduce 16-bit integers: they travel as int32, whose
// low 16 bits wrap exactly as int16 arithmetic would.
at::ScalarType reductionDtype(at::ScalarType dtype);
// Booleans travel as bytes (0 or 1), "any" being MAX and "all" MIN.
at::Tensor asReducible(const at::Tensor& t);
// The op a sub-group reduces with: AVG sums (its 1/N is ours, premultiplied).
c10d::ReduceOp groupOp(RedOp op, at::ScalarType original);
// Whether AVG divides each rank's input by N before it sums, as NCCL's AVG
// premultiplies floating types by 1/N (src/enqueue.cc, hostToDevRedOp: a
// premultiplied sum): for float16 and bfloat16, where a sum of values near the
// top of their range overflows before a division at the end. Divided rather
// than multiplied by a rounded 1/N, so that x/N is exact wherever it can be.
// 32- and 64-bit floats are summed and divided once, exact wherever the sum
// and quotient are (the range is no concern there, and the order of NCCL's
// sums differs in any case).
inline bool premultiplies(RedOp op, at::ScalarType dtype) {
  return op == RedOp::AVG && (dtype == at::kHalf || dtype == at::kBFloat16);
}
// out = the reduction of the rows of `rows` ([M, n] -> [n]).
void reduceRows(const at::Tensor& rows, at::Tensor& out, RedOp op, at::ScalarType original);
// `elems` elements of `dtype` in the byte tensor `staging`, from byte `offset`.
at::Tensor region(const at::Tensor& staging, size_t offset, int64_t elems, at::ScalarType dtype);
// `bytes` rounded up to 256, where each staging region starts.
inline size_t aligned256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

} // namespace fairring
