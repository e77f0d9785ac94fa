#include "subgroups/reduction.h"

#include <c10/util/Exception.h>

#include "ops/reduce_kind.h"

namespace fairring {

at::ScalarType reductionDtype(at::ScalarType dtype) {
  return dtype == at::kShort ? at::kInt : dtype;
}

at::Tensor asReducible(const at::Tensor& t) {
  return t.scalar_type() == at::kBool ? t.view(at::kByte) : t;
}

c10d::ReduceOp groupOp(RedOp op, at::ScalarType original) {
  if (original == at::kBool) {
    return c10d::ReduceOp((op == RedOp::SUM || op == RedOp::MAX) ? RedOp::MAX : RedOp::MIN);
  }
  return c10d::ReduceOp(op == RedOp::AVG ? RedOp::SUM : op);
}

void reduceRows(const at::Tensor& rows, at::Tensor& out, RedOp op, at::ScalarType original) {
  if (original == at::kBool) {
    op = (op == RedOp::SUM || op == RedOp::MAX) ? RedOp::MAX : RedOp::MIN;
  }
  switch (op) {
    case RedOp::SUM:
    case RedOp::AVG:
      at::sum_out(out, rows, {0}, false, out.scalar_type());
      return;
    case RedOp::MAX:
      at::amax_out(out, rows, {0});
      return;
    case RedOp::MIN:
      at::amin_out(out, rows, {0});
      return;
    case RedOp::PRODUCT:
      at::prod_out(out, rows, 0, false, out.scalar_type());
      return;
    default:
      TORCH_INTERNAL_ASSERT(false, "fairring: unchecked reduce op ", opName(op));
  }
}

at::Tensor region(const at::Tensor& staging, size_t offset, int64_t elems, at::ScalarType dtype) {
  const int64_t size = elems * static_cast<int64_t>(c10::elementSize(dtype));
  return staging.narrow(0, static_cast<int64_t>(offset), size).view(dtype);
}


} // namespace fairring
