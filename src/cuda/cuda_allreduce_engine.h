#pragma once

#ifdef FAIRRING_WITH_CUDA

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cuda/cuda_slice_plan.h"
#include "cuda/cuda_staging.h"
#include "cuda/local_collectives.h"
#include "pipeline/allreduce_engine.h"
#include "pipeline/task_queue.h"
#include "topology/rank_layout.h"

namespace fairring {

struct CudaEngineOptions {
  size_t sliceBytes;
  size_t totalMemory; // per process, for the GPU staging and, apart, the host staging
  std::chrono::milliseconds timeout;
  std::string listenAddress;
  std::string token;
  std::vector<std::string> hostnames; // per global rank
  // Two NCCL groups over the ranks of this machine; null with one rank per machine.
  c10::intrusive_ptr<c10d::Backend> localReduceGroup;
  c10::intrusive_ptr<c10d::Backend> localGatherGroup;
};

// The reduction-server allreduce on CUDA tensors. Per slice:
//   1. reduce-scatter inside the machine on NCCL (in place, padded slices);
//   2. my chunk to pinned host memory, then the rail exchange (collect, reduce,
//      diffuse) by a CPU AllreduceEngine over my rail only, whose lanes and
//      staging discipline keep it deadlock-free;
//   3. the reduced chunk back to the GPU (AVG divides here, once);
//   4. all-gather inside the machine on NCCL.
// One machine runs a single NCCL allreduce instead; one rank per machine skips
// 1 and 4. Each phase has its own CUDA stream, so slices and operations overlap;
// events order the phases, and host notifications from the streams tell the
// pipeline when bytes are on the host or a slice is finished.
//
// Threads: the caller validates and records where its stream stands; one
// issuer thread makes every CUDA and NCCL call, in the order that keeps every
// rank's NCCL calls identical; CUDA's callback thread only updates state; a
// completion thread completes futures (user callbacks run there).
class CudaAllreduceEngine {
 public:
  using Future = c10::ivalue::Future;
  using RedOp = c10d::ReduceOp::RedOpType;

  CudaAllreduceEngine(const RankLayout& layout, CudaEngineOptions options, c10::intrusive_ptr<c10d::Store> store);
  ~CudaAllreduceEngine();

  // c10d entry points; tensors are CUDA tensors of one device.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, RedOp op, int rank);
  c10::intrusive_ptr<c10d::Work> allreduceCoalesced(std::vector<at::Tensor>& tensors, RedOp op, int rank);

  // Fails what is in flight and stops the threads and the rail connections.
  void shutdown();

 private:
  struct Slice;
  struct Op;
  // A unit waiting to start, in the global order every rank shares: a slice,
  // or (index -1) a whole one-machine allreduce.
  using Key = std::pair<uint64_t, int64_t>;

  c10::intrusive_ptr<Future> enqueue(
      at::Tensor work,
      RedOp op,
      std::vector<at::Tensor> outputs,
      std::function<void()> finish);
  void ensureStarted(c10::Device device);
  size_t railSlotBytes(size_t hostSlot) const;

  // Under mu_.
  void pumpLocked();
  void failLocked(const std::string& message);
  bool lookupLocked(Key key, Op*& op, Slice*& slice);

  // On the issuer thread.
  void issueAllreduce(uint64_t seq);
  void issueReduceScatter(Key key);
  void issueRail(Key key);
  void issueChunkToGpu(Key key);
  void chunkFinal(Key key);
  void issueAllGather(Key key, Op& op, Slice& slice);
  void finishOp(uint64_t seq);
  void notify(const c10::cuda::CUDAStream& stream, std::function<void()> fn);

  // On CUDA's callback thread (or a rail thread): state only, no CUDA calls.
  void onChunkOnHost(Key key);
  void onSliceDone(Key key);

  // On the completion thread.
  void completeOp(uint64_t seq);

  void fail(const std::string& message);

  const RankLayout layout_;
  const CudaEngineOptions options_;
  const c10::intrusive_ptr<c10d::Store> store_;

  // Set once by ensureStarted (under startMu_), read-only afterwards.
  std::mutex startMu_;
  bool started_{false};
  c10::Device device_{c10::kCUDA, 0};
  size_t sliceBytes_{0};
  std::optional<c10::cuda::CUDAStream> rsStream_, d2hStream_, h2dStream_, agStream_, finalStream_;
  std::unique_ptr<LocalCollectives> local_;
  std::unique_ptr<AllreduceEngine> rail_;

  std::mutex mu_;
  std::string failure_;
  bool stopping_{false};
  uint64_t nextSeq_{0};
  std::map<uint64_t, std::unique_ptr<Op>> ops_;
  // Failed operations: the GPU may still use their tensors; freed at the end.
  std::vector<std::unique_ptr<Op>> graveyard_;
  std::deque<Key> waiting_; // for a staging slot, in global order
  std::deque<Key> gatherOrder_; // slices whose all-gather is not yet issued, in global order
  std::unique_ptr<CudaStaging> staging_;

  TaskQueue issuer_;
  TaskQueue completions_;
};

} // namespace fairring

#endif // FAIRRING_WITH_CUDA
