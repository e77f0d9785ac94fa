#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>

#include "common/status.h"

namespace fairring {

// Checks that allreduce supports `op` on `dtype`; the message names both.
Status checkReducible(c10d::ReduceOp::RedOpType op, at::ScalarType dtype);

// Whether Gloo's allreduce takes `op` on `dtype` and gives what fairring's
// would (Gloo has no AVG; int16 and bool are left to the engine).
bool glooReduces(at::ScalarType dtype, c10d::ReduceOp::RedOpType op);

// dst = dst (op) src, element-wise, in place. Both are 1-D, same dtype, same size.
void reduceInto(const at::Tensor& dst, const at::Tensor& src, c10d::ReduceOp::RedOpType op);

// The last step of AVG: divide the fully reduced values by the world size.
void finishReduction(const at::Tensor& values, c10d::ReduceOp::RedOpType op, int worldSize);

std::string opName(c10d::ReduceOp::RedOpType op);

// The name a Python user knows the dtype by ("int8", not c10's "Char").
std::string dtypeName(at::ScalarType dtype);

} // namespace fairring
