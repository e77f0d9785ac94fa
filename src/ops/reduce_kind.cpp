#include "ops/reduce_kind.h"

namespace fairring {

using Op = c10d::ReduceOp::RedOpType;

std::string opName(Op op) {
  switch (op) {
    case Op::SUM: return "SUM";
    case Op::AVG: return "AVG";
    case Op::PRODUCT: return "PRODUCT";
    case Op::MIN: return "MIN";
    case Op::MAX: return "MAX";
    case Op::BAND: return "BAND";
    case Op::BOR: return "BOR";
    case Op::BXOR: return "BXOR";
    case Op::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

std::string dtypeName(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kComplexHalf: return "complex32";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    case at::kUInt16: return "uint16";
    case at::kUInt32: return "uint32";
    case at::kUInt64: return "uint64";
    default: return c10::toString(t);
  }
}

static bool isSupportedDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kByte:
    case at::kBool:
      return true;
    default:
      return false;
  }
}

Status checkReducible(Op op, at::ScalarType dtype) {
  const std::string what = "ReduceOp." + opName(op) + " on dtype torch." + dtypeName(dtype);
  if (!isSupportedDtype(dtype)) {
    return Status::error(
        "fairring: allreduce does not support " + what +
        ": supported dtypes are float32, float64, float16, bfloat16, int8, int16, int32, "
        "int64, uint8 and bool");
  }
  switch (op) {
    case Op::SUM:
    case Op::MIN:
    case Op::MAX:
    case Op::PRODUCT:
      return Status();
    case Op::AVG:
      if (at::isFloatingType(dtype)) {
        return Status();
      }
      // Averaging integers would silently truncate; say so rather than guess.
      return Status::error(
          "fairring: allreduce does not support " + what +
          ": AVG needs a floating-point dtype (use SUM and divide)");
    default:
      return Status::error(
          "fairring: allreduce does not support " + what +
          ": supported ops are SUM, AVG, MIN, MAX and PRODUCT");
  }
}

bool glooReduces(at::ScalarType dtype, Op op) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong: break;
    default: return false;
  }
  return op == Op::SUM || op == Op::MIN || op == Op::MAX || op == Op::PRODUCT;
}

void reduceInto(const at::Tensor& dst, const at::Tensor& src, Op op) {
  if (dst.scalar_type() == at::kBool) {
    // Booleans: SUM and MAX are "any", MIN and PRODUCT are "all".
    if (op == Op::SUM || op == Op::MAX) {
      dst.logical_or_(src);
    } else {
      dst.logical_and_(src);
    }
    return;
  }
  switch (op) {
    case Op::SUM:
    case Op::AVG:
      dst.add_(src);
      return;
    case Op::PRODUCT:
      dst.mul_(src);
      return;
    case Op::MIN:
      at::minimum_out(const_cast<at::Tensor&>(dst), dst, src);
      return;
    case Op::MAX:
      at::maximum_out(const_cast<at::Tensor&>(dst), dst, src);
      return;
    default:
      TORCH_INTERNAL_ASSERT(false, "fairring: unchecked reduce op ", opName(op));
  }
}

void finishReduction(const at::Tensor& values, Op op, int worldSize) {
  if (op == Op::AVG && worldSize > 1) {
    values.div_(worldSize);
  }
}

} // namespace fairring
