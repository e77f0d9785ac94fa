#pragma once

#ifdef FAIRRING_WITH_CUDA

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace fairring {

// The intra-node steps on NCCL, through two torch ProcessGroupNCCL over the
// ranks of this machine (built by fairring_pg/backend.py). Two groups, because
// NCCL runs one communicator's collectives in the order they were issued and
// every rank must issue them in the same order: reduce-scatters are issued in
// slice order as slices start, all-gathers in slice order as their chunks
// become final, and the two orders interleave differently on different ranks.
//
// Every call is enqueued after the work already on the caller's current CUDA
// stream and, before returning, makes that stream wait for it (the host never
// blocks). Buffers are padded slices of L * chunk elements; chunk l belongs to
// local rank l.
class LocalCollectives {
 public:
  LocalCollectives(
      c10::intrusive_ptr<c10d::Backend> reduceGroup,
      c10::intrusive_ptr<c10d::Backend> gatherGroup,
      int localRank,
      int localSize);

  // After it, chunk `localRank` of `buf` holds the reduction over the local
  // ranks (AVG sums: the division happens once the chunk is complete).
  void reduceScatter(const at::Tensor& buf, int64_t chunk, c10d::ReduceOp::RedOpType op);
  // Every chunk of `buf` from its owner to every local rank.
  void allGather(const at::Tensor& buf, int64_t chunk);
  // The whole reduction inside the machine, for a job of one machine.
  void allreduce(const at::Tensor& tensor, c10d::ReduceOp::RedOpType op);

  // Whether NCCL reduces this dtype itself (int16 it does not).
  static bool ncclReduces(at::ScalarType dtype);

 private:
  const c10::intrusive_ptr<c10d::Backend> reduceGroup_;
  const c10::intrusive_ptr<c10d::Backend> gatherGroup_;
  const int localRank_;
  const int localSize_;
};

} // namespace fairring

#endif // FAIRRING_WITH_CUDA
