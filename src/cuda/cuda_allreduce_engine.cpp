#ifdef FAIRRING_WITH_CUDA

#include "cuda/cuda_allreduce_engine.h"

#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "cuda/cuda_work.h"
#include "cuda/stream_notify.h"
#include "ops/reduce_kind.h"
#include "ops/tensor_fusion.h"
#include "staging/staging_pool.h"

namespace fairring {

namespace {
// The rail exchange wants a few slices in flight to overlap copies and network;
// the slice shrinks (never below this per chunk) until two fit the staging memory.
constexpr size_t kMinChunkBytes = 64 << 10;

std::exception_ptr makeError(const std::string& message) {
  return std::make_exception_ptr(c10::DistBackendError(message));
}

void checkCudaTensor(const at::Tensor& t, const std::string& name) {
  TORCH_CHECK(t.defined(), "fairring: ", name, " is undefined");
  TORCH_CHECK(
      t.layout() == at::kStrided, "fairring: ", name, " has layout ", t.layout(),
      "; allreduce supports dense (strided) tensors only");
  TORCH_CHECK(t.device().is_cuda(), "fairring: ", name, " is on ", t.device(), ", not a CUDA device");
}
} // namespace

struct CudaAllreduceEngine::Slice {
  int64_t begin{0};
  int64_t size{0};
  int64_t chunk{0};
  bool padded{false};
  int slot{-1};
  at::Tensor buf; // the padded slice on the GPU: a view of the work tensor, or staging
  at::Tensor hostChunk; // my chunk in pinned memory (several machines only)
  c10::cuda::CUDAEvent chunkReady; // my chunk is final on the GPU
  bool chunkFinal{false};
};

struct CudaAllreduceEngine::Op {
  uint64_t seq{0};
  at::Tensor work; // flat, contiguous
  RedOp op{RedOp::SUM};
  std::vector<at::Tensor> outputs;
  std::function<void()> finish;
  c10::intrusive_ptr<Future> future;
  c10::cuda::CUDAEvent ready; // where the caller's stream stood at enqueue
  std::vector<std::unique_ptr<Slice>> slices;
  int64_t unitsLeft{0};
};

CudaAllreduceEngine::CudaAllreduceEngine(
    const RankLayout& layout,
    CudaEngineOptions options,
    c10::intrusive_ptr<c10d::Store> store)
    : layout_(layout), options_(std::move(options)), store_(std::move(store)) {}

CudaAllreduceEngine::~CudaAllreduceEngine() {
  shutdown();
}

size_t CudaAllreduceEngine::railSlotBytes(size_t hostSlot) const {
  return layout_.numMachines() > 1 ? stagingSlotBytes(hostSlot, 1, layout_.numMachines()) : 0;
}

void CudaAllreduceEngine::ensureStarted(c10::Device device) {
  std::lock_guard<std::mutex> start(startMu_);
  if (started_) {
    TORCH_CHECK(
        device == device_, "fairring: a CUDA allreduce on ", device, " but this process group's CUDA allreduces run on ",
        device_, "; use one GPU per process");
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty()) {
      throw c10::DistBackendError(failure_ + " (this process group failed earlier and cannot be used)");
    }
  }
  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  // Every rank computes the same sizes from the same inputs: the plans agree.
  auto slotsFor = [&](size_t slice) -> size_t {
    const size_t host = cudaHostSlotBytes(slice, L) * (M > 1 ? 1 : 0) + railSlotBytes(cudaHostSlotBytes(slice, L));
    const size_t dev = cudaDeviceSlotBytes(slice, L);
    size_t slots = host > 0 ? options_.totalMemory / host : 1024;
    if (dev > 0) {
      slots = std::min(slots, options_.totalMemory / dev);
    }
    return slots;
  };
  size_t slice = options_.sliceBytes;
  while (slotsFor(slice) < 2 && slice / 2 >= kMinChunkBytes * static_cast<size_t>(L)) {
    slice /= 2;
  }
  const size_t slots = slotsFor(slice);
  if (slots == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = "fairring: FAIRRING_TOTAL_MEMORY=" + std::to_string(options_.totalMemory) +
        " cannot hold one CUDA staging slot for slices of " + std::to_string(slice) + " bytes (" +
        std::to_string(cudaHostSlotBytes(slice, L)) + " pinned + " +
        std::to_string(railSlotBytes(cudaHostSlotBytes(slice, L))) + " host staging + " +
        std::to_string(cudaDeviceSlotBytes(slice, L)) + " on the GPU); raise it or lower FAIRRING_SLICE_SIZE";
    throw c10::DistBackendError(failure_);
  }
  const size_t hostSlot = cudaHostSlotBytes(slice, L);
  c10::cuda::CUDAGuard guard(device);
  try {
    staging_ = std::make_unique<CudaStaging>(slots, M > 1 ? hostSlot : 64, cudaDeviceSlotBytes(slice, L), device);
    if (L > 1) {
      local_ = std::make_unique<LocalCollectives>(
          options_.localReduceGroup, options_.localGatherGroup, layout_.localRank(), L);
    }
    if (M > 1) {
      // My rail alone: one rank per "machine", so the engine runs only its
      // collect / reduce / diffuse, over TCP, with listeners of its own.
      std::vector<int> machineOf;
      std::vector<std::string> hosts;
      for (int m = 0; m < M; ++m) {
        const int global = layout_.rankOf(m, layout_.localRank());
        machineOf.push_back(m);
        // Errors of the rail engine name rail positions; say which rank that is.
        hosts.push_back(options_.hostnames.at(global) + (global == m ? "" : ", global rank " + std::to_string(global)));
      }
      RankLayout railLayout(layout_.machine(), machineOf, hosts);
      EngineOptions railOptions{hostSlot, slots * railSlotBytes(hostSlot), options_.timeout, options_.listenAddress,
                                options_.token, ""};
      rail_ = std::make_unique<AllreduceEngine>(std::move(railLayout), std::move(railOptions));
      auto railStore = c10::make_intrusive<c10d::PrefixStore>("cuda/rail/", store_);
      rail_->start(*railStore);
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = std::string("fairring: starting the CUDA allreduce failed on ") + layout_.describe(layout_.rank()) +
        ": " + e.what();
    throw c10::DistBackendError(failure_);
  }
  const auto index = device.index();
  rsStream_ = c10::cuda::getStreamFromPool(false, index);
  d2hStream_ = c10::cuda::getStreamFromPool(false, index);
  h2dStream_ = c10::cuda::getStreamFromPool(false, index);
  agStream_ = c10::cuda::getStreamFromPool(false, index);
  finalStream_ = c10::cuda::getStreamFromPool(false, index);
  device_ = device;
  sliceBytes_ = slice;
  started_ = true;
}

c10::intrusive_ptr<c10d::Work> CudaAllreduceEngine::allreduce(std::vector<at::Tensor>& tensors, RedOp op, int rank) {
  TORCH_CHECK(
      tensors.size() == 1, "fairring: allreduce takes exactly one tensor per process, got ", tensors.size());
  at::Tensor& tensor = tensors[0];
  checkCudaTensor(tensor, "the allreduce tensor");
  c10::cuda::CUDAGuard guard(tensor.device());
  // A dense copy, made on the caller's stream; the result is written back.
  at::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
  std::function<void()> finish;
  if (!work.is_same(tensor)) {
    finish = [tensor, work]() mutable { tensor.copy_(work); };
  }
  auto future = enqueue(work.view({-1}), op, {tensor}, std::move(finish));
  return c10::make_intrusive<CudaFutureWork>(rank, c10d::OpType::ALLREDUCE, "fairring:all_reduce", tensors, future);
}

c10::intrusive_ptr<c10d::Work> CudaAllreduceEngine::allreduceCoalesced(
    std::vector<at::Tensor>& tensors,
    RedOp op,
    int rank) {
  TORCH_CHECK(!tensors.empty(), "fairring: allreduce_coalesced needs at least one tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = "tensor " + std::to_string(i) + " of allreduce_coalesced";
    checkCudaTensor(tensors[i], name);
    TORCH_CHECK(
        tensors[i].scalar_type() == tensors[0].scalar_type() && tensors[i].device() == tensors[0].device(),
        "fairring: ", name, " is ", tensors[i].scalar_type(), " on ", tensors[i].device(), " but tensor 0 is ",
        tensors[0].scalar_type(), " on ", tensors[0].device(), "; coalesced tensors must share dtype and device");
  }
  c10::cuda::CUDAGuard guard(tensors[0].device());
  Fusion fusion = fuse(tensors);
  auto future = enqueue(fusion.fused, op, tensors, std::move(fusion.scatterBack));
  return c10::make_intrusive<CudaFutureWork>(
      rank, c10d::OpType::ALLREDUCE_COALESCED, "fairring:all_reduce_coalesced", tensors, future);
}

c10::intrusive_ptr<CudaAllreduceEngine::Future> CudaAllreduceEngine::enqueue(
    at::Tensor work,
    RedOp op,
    std::vector<at::Tensor> outputs,
    std::function<void()> finish) {
  const Status reducible = checkReducible(op, work.scalar_type());
  if (!reducible.ok()) {
    throw c10::DistBackendError(reducible.message());
  }
  const c10::Device device = work.device();
  // Collective: every rank's first CUDA allreduce gets here, so the rail
  // connections are made when CUDA is used and never for a CPU-only job.
  ensureStarted(device);

  auto o = std::make_unique<Op>();
  o->work = std::move(work);
  o->op = op;
  o->outputs = std::move(outputs);
  o->finish = std::move(finish);
  o->future = c10::make_intrusive<Future>(c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device});
  // The pipeline's streams start where the caller's stream stands now.
  o->ready.record(c10::cuda::getCurrentCUDAStream(device.index()));
  auto future = o->future;

  const int L = layout_.localSize();
  const int M = layout_.numMachines();
  const int64_t numel = o->work.numel();
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.empty()) {
    throw c10::DistBackendError(failure_ + " (this process group failed earlier and cannot be used)");
  }
  const uint64_t seq = nextSeq_++;
  o->seq = seq;
  if (numel == 0 || layout_.worldSize() == 1) {
    // Nothing to exchange; still in order, so completion follows the caller.
    ops_[seq] = std::move(o);
    issuer_.post([this, seq] { finishOp(seq); });
  } else if (M == 1 && LocalCollectives::ncclReduces(o->work.scalar_type())) {
    o->unitsLeft = 1;
    ops_[seq] = std::move(o);
    waiting_.emplace_back(seq, -1);
  } else {
    CudaSlicePlan plan(numel, sliceBytes_, o->work.element_size(), L);
    o->unitsLeft = plan.numSlices();
    for (int64_t s = 0; s < plan.numSlices(); ++s) {
      auto slice = std::make_unique<Slice>();
      slice->begin = plan.begin(s);
      slice->size = plan.size(s);
      slice->chunk = plan.chunk(s);
      slice->padded = L > 1 && plan.padded(s);
      o->slices.push_back(std::move(slice));
      waiting_.emplace_back(seq, s);
    }
    ops_[seq] = std::move(o);
  }
  pumpLocked();
  return future;
}

bool CudaAllreduceEngine::lookupLocked(Key key, Op*& op, Slice*& slice) {
  auto it = ops_.find(key.first);
  if (it == ops_.end()) {
    return false;
  }
  op = it->second.get();
  slice = key.second >= 0 ? op->slices[key.second].get() : nullptr;
  return true;
}

void CudaAllreduceEngine::pumpLocked() {
  // Units start in one global order on every rank, so each NCCL group sees
  // the same sequence of calls everywhere and the rail engine the same
  // sequence of operations.
  while (!waiting_.empty()) {
    const Key key = waiting_.front();
    Op* op = nullptr;
    Slice* slice = nullptr;
    if (!lookupLocked(key, op, slice)) {
      waiting_.pop_front();
      continue;
    }
    if (slice == nullptr) {
      waiting_.pop_front();
      issuer_.post([this, seq = key.first] { issueAllreduce(seq); });
      continue;
    }
    const int slot = staging_->tryAcquire();
    if (slot < 0) {
      return; // back-pressure: a finishing slice calls us again
    }
    waiting_.pop_front();
    slice->slot = slot;
    if (layout_.localSize() > 1) {
      gatherOrder_.push_back(key);
    }
    issuer_.post([this, key] { issueReduceScatter(key); });
  }
}

void CudaAllreduceEngine::notify(const c10::cuda::CUDAStream& stream, std::function<void()> fn) {
  const Status status = notifyWhenReached(stream, std::move(fn));
  if (!status.ok()) {
    throw std::runtime_error(status.message());
  }
}

void CudaAllreduceEngine::issueAllreduce(uint64_t seq) {
  Op* op = nullptr;
  Slice* unused = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!lookupLocked({seq, -1}, op, unused)) {
      return;
    }
  }
  try {
    c10::cuda::CUDAGuard guard(device_);
    c10::cuda::CUDAStreamGuard onStream(*rsStream_);
    op->ready.block(*rsStream_);
    local_->allreduce(op->work, op->op);
    finishReduction(op->work, op->op, layout_.worldSize());
    notify(*rsStream_, [this, seq] { onSliceDone({seq, -1}); });
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void CudaAllreduceEngine::issueReduceScatter(Key key) {
  Op* op = nullptr;
  Slice* slice = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!lookupLocked(key, op, slice)) {
      return;
    }
  }
  const int L = layout_.localSize();
  const int64_t chunk = slice->chunk;
  try {
    c10::cuda::CUDAGuard guard(device_);
    c10::cuda::CUDAStreamGuard onStream(*rsStream_);
    op->ready.block(*rsStream_);
    at::Tensor region = op->work.narrow(0, slice->begin, slice->size);
    if (slice->padded) {
      slice->buf = staging_->device(slice->slot, op->work.scalar_type(), L * chunk);
      slice->buf.narrow(0, 0, slice->size).copy_(region);
      // Padding is reduced like data and then dropped; zeros keep it tame.
      slice->buf.narrow(0, slice->size, L * chunk - slice->size).zero_();
    } else {
      slice->buf = region;
    }
    if (L > 1) {
      local_->reduceScatter(slice->buf, chunk, op->op);
    }
    at::Tensor mine = slice->buf.narrow(0, layout_.localRank() * chunk, chunk);
    if (layout_.numMachines() > 1) {
      slice->hostChunk = staging_->host(slice->slot, op->work.scalar_type(), chunk);
      c10::cuda::CUDAEvent scattered;
      scattered.record(*rsStream_);
      scattered.block(*d2hStream_);
      c10::cuda::CUDAStreamGuard onCopy(*d2hStream_);
      slice->hostChunk.copy_(mine, /*non_blocking=*/true);
      notify(*d2hStream_, [this, key] { onChunkOnHost(key); });
    } else {
      finishReduction(mine, op->op, layout_.worldSize());
      slice->chunkReady.record(*rsStream_);
      chunkFinal(key);
    }
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void CudaAllreduceEngine::onChunkOnHost(Key key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.empty()) {
    // Through the issuer: the rail engine must see operations in slice order.
    issuer_.post([this, key] { issueRail(key); });
  }
}

void CudaAllreduceEngine::issueRail(Key key) {
  Op* op = nullptr;
  Slice* slice = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!lookupLocked(key, op, slice)) {
      return;
    }
  }
  // AVG travels as SUM; the chunk's owner divides by the whole world once.
  const RedOp railOp = op->op == RedOp::AVG ? RedOp::SUM : op->op;
  try {
    auto railFuture = rail_->enqueue(slice->hostChunk, railOp, {}, nullptr);
    railFuture->addCallback([this, key](Future& f) {
      if (f.hasError()) {
        fail(f.tryRetrieveErrorMessage());
      } else {
        issuer_.post([this, key] { issueChunkToGpu(key); });
      }
    });
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void CudaAllreduceEngine::issueChunkToGpu(Key key) {
  Op* op = nullptr;
  Slice* slice = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!lookupLocked(key, op, slice)) {
      return;
    }
  }
  try {
    c10::cuda::CUDAGuard guard(device_);
    c10::cuda::CUDAStreamGuard onStream(*h2dStream_);
    at::Tensor mine = slice->buf.narrow(0, layout_.localRank() * slice->chunk, slice->chunk);
    mine.copy_(slice->hostChunk, /*non_blocking=*/true);
    finishReduction(mine, op->op, layout_.worldSize());
    slice->chunkReady.record(*h2dStream_);
    if (layout_.localSize() == 1) {
      notify(*h2dStream_, [this, key] { onSliceDone(key); });
    } else {
      chunkFinal(key);
    }
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void CudaAllreduceEngine::chunkFinal(Key key) {
  // All-gathers go out in global slice order, whatever order chunks finish in.
  struct Ready {
    Key key;
    Op* op;
    Slice* slice;
  };
  std::vector<Ready> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Op* op = nullptr;
    Slice* slice = nullptr;
    if (!lookupLocked(key, op, slice)) {
      return;
    }
    slice->chunkFinal = true;
    while (!gatherOrder_.empty()) {
      if (!lookupLocked(gatherOrder_.front(), op, slice)) {
        gatherOrder_.pop_front();
        continue;
      }
      if (!slice->chunkFinal) {
        break;
      }
      ready.push_back({gatherOrder_.front(), op, slice});
      gatherOrder_.pop_front();
    }
  }
  for (const Ready& r : ready) {
    issueAllGather(r.key, *r.op, *r.slice);
  }
}

void CudaAllreduceEngine::issueAllGather(Key key, Op& op, Slice& slice) {
  try {
    c10::cuda::CUDAGuard guard(device_);
    c10::cuda::CUDAStreamGuard onStream(*agStream_);
    slice.chunkReady.block(*agStream_);
    local_->allGather(slice.buf, slice.chunk);
    if (slice.padded) {
      op.work.narrow(0, slice.begin, slice.size).copy_(slice.buf.narrow(0, 0, slice.size));
    }
    notify(*agStream_, [this, key] { onSliceDone(key); });
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void CudaAllreduceEngine::onSliceDone(Key key) {
  std::lock_guard<std::mutex> lock(mu_);
  Op* op = nullptr;
  Slice* slice = nullptr;
  if (!failure_.empty() || !lookupLocked(key, op, slice)) {
    return;
  }
  if (slice != nullptr) {
    staging_->release(slice->slot);
    slice->slot = -1;
  }
  if (--op->unitsLeft == 0) {
    issuer_.post([this, seq = key.first] { finishOp(seq); });
  }
  pumpLocked();
}

void CudaAllreduceEngine::finishOp(uint64_t seq) {
  Op* op = nullptr;
  Slice* unused = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!lookupLocked({seq, -1}, op, unused)) {
      return;
    }
  }
  try {
    c10::cuda::CUDAGuard guard(device_);
    c10::cuda::CUDAStreamGuard onStream(*finalStream_);
    // The slices are finished on the GPU already; an operation with nothing to
    // exchange only needs to follow the caller.
    op->ready.block(*finalStream_);
    if (op->finish) {
      op->finish();
    }
    // Completing only once the GPU is done lets Work.wait() release the
    // caller's stream on completion alone.
    notify(*finalStream_, [this, seq] { completions_.post([this, seq] { completeOp(seq); }); });
  } catch (const std::exception& e) {
    fail(std::string("fairring: completing a CUDA allreduce failed: ") + e.what());
  }
}

void CudaAllreduceEngine::completeOp(uint64_t seq) {
  std::unique_ptr<Op> op;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find(seq);
    if (it == ops_.end()) {
      return;
    }
    op = std::move(it->second);
    ops_.erase(it);
  }
  c10::cuda::CUDAGuard guard(device_);
  c10::cuda::CUDAStreamGuard onStream(*finalStream_);
  op->future->markCompleted(c10::IValue(op->outputs));
}

void CudaAllreduceEngine::fail(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  failLocked(message);
}

void CudaAllreduceEngine::failLocked(const std::string& message) {
  if (!failure_.empty()) {
    return;
  }
  failure_ = message;
  for (auto& [seq, op] : ops_) {
    // Not here: this may be CUDA's callback thread, and callbacks may use CUDA.
    completions_.post([future = op->future, message] { future->setError(makeError(message)); });
    graveyard_.push_back(std::move(op));
  }
  ops_.clear();
  waiting_.clear();
  gatherOrder_.clear();
}

void CudaAllreduceEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      return;
    }
    stopping_ = true;
    failLocked("fairring: the process group was shut down while this CUDA allreduce was in flight");
  }
  issuer_.stop();
  if (rail_) {
    rail_->shutdown();
  }
  completions_.stop();
  std::lock_guard<std::mutex> start(startMu_);
  if (started_) {
    // Nothing may still write into staging or the failed operations' tensors.
    c10::cuda::CUDAGuard guard(device_);
    try {
      c10::cuda::device_synchronize();
    } catch (const std::exception&) {
      // A broken device: nothing left to protect.
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  graveyard_.clear();
}

} // namespace fairring

#endif // FAIRRING_WITH_CUDA
