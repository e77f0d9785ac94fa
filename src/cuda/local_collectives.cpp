#ifdef FAIRRING_WITH_CUDA

#include "cuda/local_collectives.h"

#include <c10/util/Exception.h>

#include <string>

#include "ops/reduce_kind.h"

namespace fairring {

using RedOp = c10d::ReduceOp::RedOpType;

namespace {

// What NCCL is asked to do for (dtype, op): bool travels as uint8, where "any"
// is MAX and "all" is MIN; AVG is a SUM divided later by the world size.
std::pair<at::Tensor, RedOp> asNccl(const at::Tensor& t, RedOp op) {
  if (t.scalar_type() == at::kBool) {
    return {t.view(at::kByte), (op == RedOp::SUM || op == RedOp::MAX) ? RedOp::MAX : RedOp::MIN};
  }
  return {t, op == RedOp::AVG ? RedOp::SUM : op};
}

// Names the likely cause of the most common failure: NCCL refuses two ranks
// of one communicator on one GPU.
[[noreturn]] void rethrowWithContext(const char* what, const std::exception& e) {
  throw c10::DistBackendError(
      std::string("fairring: the intra-node ") + what + " on NCCL failed: " + e.what() +
      " (NCCL needs one GPU per rank of a machine; ranks that share a GPU must each be their own machine, "
      "e.g. with distinct FAIRRING_MACHINE_ID)");
}

} // namespace

LocalCollectives::LocalCollectives(
    c10::intrusive_ptr<c10d::Backend> reduceGroup,
    c10::intrusive_ptr<c10d::Backend> gatherGroup,
    int localRank,
    int localSize)
    : reduceGroup_(std::move(reduceGroup)),
      gatherGroup_(std::move(gatherGroup)),
      localRank_(localRank),
      localSize_(localSize) {
  TORCH_CHECK(
      localSize_ == 1 || (reduceGroup_ && gatherGroup_),
      "fairring: CUDA allreduce with ", localSize_, " ranks per machine needs the intra-node NCCL groups");
}

bool LocalCollectives::ncclReduces(at::ScalarType dtype) {
  return dtype != at::kShort;
}

void LocalCollectives::reduceScatter(const at::Tensor& buf, int64_t chunk, RedOp op) {
  at::Tensor mine = buf.narrow(0, localRank_ * chunk, chunk);
  try {
    if (ncclReduces(buf.scalar_type())) {
      auto [input, ncclOp] = asNccl(buf, op);
      at::Tensor output = asNccl(mine, op).first;
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = c10d::ReduceOp(ncclOp);
      // In place: NCCL allows the output to be the input's own piece.
      reduceGroup_->_reduce_scatter_base(output, input, opts)->wait();
      return;
    }
    // int16: exchange the raw pieces (chunk j to local rank j), then reduce
    // them here on the GPU, on the current stream, in local-rank order.
    at::Tensor pieces = at::empty_like(buf);
    at::Tensor out = pieces.view(at::kByte);
    at::Tensor in = buf.view(at::kByte);
    std::vector<int64_t> even;
    reduceGroup_->alltoall_base(out, in, even, even, c10d::AllToAllOptions())->wait();
    const RedOp reduceOp = op == RedOp::AVG ? RedOp::SUM : op;
    mine.copy_(pieces.narrow(0, 0, chunk));
    for (int j = 1; j < localSize_; ++j) {
      reduceInto(mine, pieces.narrow(0, j * chunk, chunk), reduceOp);
    }
  } catch (const std::exception& e) {
    rethrowWithContext("reduce-scatter", e);
  }
}

void LocalCollectives::allGather(const at::Tensor& buf, int64_t chunk) {
  // Raw bytes: the gather only moves data, whatever the dtype.
  at::Tensor all = buf.view(at::kByte);
  const int64_t bytes = chunk * static_cast<int64_t>(buf.element_size());
  at::Tensor mine = all.narrow(0, localRank_ * bytes, bytes);
  try {
    gatherGroup_->_allgather_base(all, mine, c10d::AllgatherOptions())->wait();
  } catch (const std::exception& e) {
    rethrowWithContext("all-gather", e);
  }
}

void LocalCollectives::allreduce(const at::Tensor& tensor, RedOp op) {
  auto [t, ncclOp] = asNccl(tensor, op);
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(ncclOp);
  try {
    reduceGroup_->allreduce(tensors, opts)->wait();
  } catch (const std::exception& e) {
    rethrowWithContext("allreduce", e);
  }
}

} // namespace fairring

#endif // FAIRRING_WITH_CUDA
