#include "subgroups/subgroup_allreduce.h"

#include <c10/util/Exception.h>

#include "ops/reduce_kind.h"
#include "ops/tensor_fusion.h"
#include "subgroups/capture_probe.h"
#include "subgroups/reduction.h"
#include "subgroups/subgroup_work.h"

namespace fairring {

SubgroupAllreduce::SubgroupAllreduce(Subgroups groups, SubgroupOptions options, c10::DeviceType deviceType)
    : groups_(std::move(groups)),
      options_(std::move(options)),
      deviceType_(deviceType),
      numLanes_(std::max<int>(1, static_cast<int>(groups_.lanes.size()))) {
  const int L = options_.localSize;
  const int M = options_.numMachines;
  TORCH_CHECK(L >= 1 && M >= 1 && L * M == options_.worldSize, "fairring: ", M, " machines x ", L,
              " ranks do not make a world of ", options_.worldSize);
  TORCH_CHECK(groups_.world, "fairring: the sub-group allreduce needs a world group");
  bool composing = false;
  for (size_t i = 0; i < options_.plan.size(); ++i) {
    TORCH_CHECK((i == 0) == (options_.plan[i].fromBytes == 0) &&
                    (i == 0 || options_.plan[i].fromBytes > options_.plan[i - 1].fromBytes),
                "fairring: the plan's rows must start at 0 bytes and grow");
    composing = composing || options_.plan[i].path == PlanPath::kCompose;
  }
  TORCH_CHECK(composing == composes(), "fairring: the plan ", composing ? "composes" : "composes no call",
              " but the rail groups were ", composes() ? "made" : "not made");
  if (!composes()) {
    return;
  }
  TORCH_CHECK(M > 1, "fairring: lanes over the rail need several machines");
  TORCH_CHECK(L == 1 || (groups_.localReduce && groups_.localGather),
              "fairring: pieces with several local ranks need the local reduce and gather groups");
  const size_t unit = 8 * static_cast<size_t>(L * M);
  TORCH_CHECK(options_.largestPieceBytes > 0 && options_.largestPieceBytes % unit == 0,
              "fairring: the largest piece (", options_.largestPieceBytes, " bytes) must be a multiple of 8*L*M = ",
              unit);
  const size_t staging = numLanes_ * options_.laneStagingBytes;
  TORCH_CHECK(staging <= options_.totalMemory, "fairring: ", numLanes_, " lanes need ", staging,
              " bytes of staging for pieces of ", options_.largestPieceBytes, " but FAIRRING_TOTAL_MEMORY is ",
              options_.totalMemory);
}

void SubgroupAllreduce::checkTensor(const at::Tensor& t, const std::string& name) const {
  TORCH_CHECK(t.defined(), "fairring: ", name, " is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "fairring: ", name, " has layout ", t.layout(),
              "; allreduce supports dense (strided) tensors only");
  TORCH_CHECK(t.device().type() == deviceType_, "fairring: ", name, " is on ", t.device(), ", expected a ",
              c10::DeviceTypeName(deviceType_, true), " tensor");
}

void SubgroupAllreduce::refuseCapture(c10::Device device) const {
  // A captured allreduce would fork the capture onto lanes that never join
  // the captured stream, and the capture fails far from here, obscurely.
  // Checked before anything is locked or planned, and thrown as a plain
  // string: on the H100 the refusal from inside run(), formatted by
  // TORCH_CHECK, crashed the process (SIGSEGV) instead of raising.
  const CaptureState state = currentStreamCapture(device);
  if (isCapturing(state)) {
    const std::string where = state == CaptureState::kImplicit
        ? "while another stream is being captured into a CUDA graph (the current stream is the legacy default "
          "stream, which a capture forbids)"
        : "while the current stream is captured into a CUDA graph";
    throw c10::DistBackendError(
        "fairring: allreduce on rank " + std::to_string(options_.rank) + " was issued " + where +
        "; fairring's CUDA allreduce runs on streams of its own and cannot be captured: issue it outside the graph");
  }
}

c10::intrusive_ptr<c10d::Work> SubgroupAllreduce::allreduce(at::Tensor& tensor, RedOp op) {
  checkTensor(tensor, "the allreduce tensor");
  refuseCapture(tensor.device());
  const Status reducible = checkReducible(op, tensor.scalar_type());
  if (!reducible.ok()) {
    throw c10::DistBackendError(reducible.message());
  }
  const at::ScalarType dtype = reductionDtype(tensor.scalar_type());
  auto prepare = [tensor, dtype]() -> Prepared {
    if (tensor.is_contiguous() && dtype == tensor.scalar_type()) {
      return Prepared{tensor.view({-1}), nullptr, {}};
    }
    // A dense copy for a view, a wider one for int16; the result is written
    // back once the reduction is done.
    at::Tensor work = tensor.contiguous().to(dtype);
    auto finish = [tensor, work]() mutable { tensor.copy_(work.view(tensor.sizes())); };
    return Prepared{work.view({-1}), std::move(finish), {}};
  };
  return run({tensor}, tensor.numel(), dtype, op, c10d::OpType::ALLREDUCE, prepare);
}

c10::intrusive_ptr<c10d::Work> SubgroupAllreduce::allreduceCoalesced(std::vector<at::Tensor>& tensors, RedOp op) {
  TORCH_CHECK(!tensors.empty(), "fairring: allreduce_coalesced needs at least one tensor");
  int64_t numel = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = "tensor " + std::to_string(i) + " of allreduce_coalesced";
    checkTensor(tensors[i], name);
    TORCH_CHECK(tensors[i].scalar_type() == tensors[0].scalar_type() && tensors[i].device() == tensors[0].device(),
                "fairring: ", name, " is torch.", dtypeName(tensors[i].scalar_type()), " on ", tensors[i].device(),
                " but tensor 0 is torch.", dtypeName(tensors[0].scalar_type()), " on ", tensors[0].device(),
                "; coalesced tensors must share dtype and device");
    numel += tensors[i].numel();
  }
  refuseCapture(tensors[0].device());
  const Status reducible = checkReducible(op, tensors[0].scalar_type());
  if (!reducible.ok()) {
    throw c10::DistBackendError(reducible.message());
  }
  const at::ScalarType dtype = reductionDtype(tensors[0].scalar_type());
  auto prepare = [tensors, dtype]() -> Prepared {
    // Tensor Fusion: one flat buffer, cut into units like any other allreduce.
    Fusion fusion = fuse(tensors);
    if (dtype == fusion.fused.scalar_type()) {
      return Prepared{fusion.fused, std::move(fusion.scatterBack), {fusion.fused}};
    }
    at::Tensor work = fusion.fused.to(dtype);
    auto finish = [fused = fusion.fused, work, scatterBack = std::move(fusion.scatterBack)]() mutable {
      fused.copy_(work);
      scatterBack();
    };
    return Prepared{work, std::move(finish), {fusion.fused}};
  };
  return run(tensors, numel, dtype, op, c10d::OpType::ALLREDUCE_COALESCED, prepare);
}

void SubgroupAllreduce::orderBefore(const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!streams_ || !streams_->onDevice()) {
    return;
  }
  const c10::Device device = streams_->device();
  const std::vector<ByteRange> ranges = byteRangesOf(tensors);
  if (isCapturing(currentStreamCapture(device))) {
    // Neither ask (a query breaks a global-mode capture) nor wait (an event
    // recorded outside the capture cannot be waited for inside it): the
    // collective is only recorded now, and torch.cuda.graph synchronises the
    // device before it starts capturing.
    if (!inFlight_.overlapping(ranges).empty()) {
      ++stats_.unorderedInCapture;
    }
    return;
  }
  inFlight_.forget([](const DoneEvent& done) { return done->query(); });
  for (const auto& event : inFlight_.overlapping(ranges)) {
    blockCurrentStream(*event, device);
    ++stats_.orderingWaits;
  }
}

void SubgroupAllreduce::orderAfter(const std::vector<at::Tensor>& tensors, c10d::Work& work) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!streams_ || !streams_->onDevice() || isCapturing(currentStreamCapture(streams_->device()))) {
    return;
  }
  DoneEvent done = streams_->markAfter([&work] { work.synchronize(); });
  inFlight_.add(byteRangesOf(tensors), std::move(done));
}

void SubgroupAllreduce::useDevice(c10::Device device) {
  std::unique_lock<std::mutex> lock(mu_);
  // Another thread may be connecting: connecting waits on the host for the
  // peers, so it runs without the lock, which abort() and destroy need.
  connected_.wait(lock, [&] { return !connecting_; });
  if (streams_) {
    TORCH_CHECK(device == streams_->device(), "fairring: an allreduce on ", device,
                " but this process group's allreduces run on ", streams_->device(), "; use one device per process");
    return;
  }
  if (!failure_.empty()) {
    return; // run() raises it
  }
  connecting_ = true;
  auto streams = std::make_unique<LaneStreams>(device, numLanes_, composes() && options_.localSize > 1);
  std::vector<at::Tensor> staging;
  std::string failure;
  lock.unlock();
  try {
    connect(*streams);
    if (composes()) {
      // Allocated once; each lane reuses its slot piece after piece, in the
      // order of its stream.
      for (int k = 0; k < numLanes_; ++k) {
        staging.push_back(streams->allocate(options_.laneStagingBytes, k));
      }
    }
  } catch (const std::exception& e) {
    failure = std::string("fairring: rank ") + std::to_string(options_.rank) +
        " could not set up its allreduce sub-groups: " + e.what();
  }
  lock.lock();
  connecting_ = false;
  connected_.notify_all();
  if (!failure.empty()) {
    failure_ = failure;
    return;
  }
  streams_ = std::move(streams);
  staging_ = std::move(staging);
}

c10::intrusive_ptr<c10d::Work> SubgroupAllreduce::run(
    std::vector<at::Tensor> outputs,
    int64_t numel,
    at::ScalarType dtype,
    RedOp op,
    c10d::OpType type,
    const std::function<Prepared()>& prepare) {
  TORCH_CHECK(!stopped_, "fairring: allreduce on rank ", options_.rank, " after the process group was shut down");
  const c10::Device device = outputs[0].device();
  useDevice(device);
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.empty()) {
    throw c10::DistBackendError(failure_ + " (this process group failed earlier and cannot be used)");
  }
  TORCH_CHECK(!stopped_, "fairring: allreduce on rank ", options_.rank, " after the process group was shut down");
  const CallPlan plan = planCall(
      numel, c10::elementSize(dtype), options_.plan, options_.largestPieceBytes, options_.localSize,
      options_.numMachines);
  const std::vector<ByteRange> ranges = byteRangesOf(outputs);
  // Asked before anything is issued, so that an error of the device's here
  // fails this call only, not the group.
  std::vector<DoneEvent> after;
  if (streams_->onDevice() && !plan.units.empty()) {
    inFlight_.forget([](const DoneEvent& done) { return done->query(); });
    after = inFlight_.overlapping(ranges);
  }
  countCall(plan, after.size());

  const std::vector<c10::Device> devices =
      streams_->onDevice() ? std::vector<c10::Device>{device} : std::vector<c10::Device>{};
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devices);
  DoneEvent done;
  parts_.clear();
  try {
    // The stream the operation is done on is current while the future is
    // marked: c10's Future records its events on the current stream, and
    // whoever waits on the future (DDP's reducer, then() callbacks) waits for
    // those. Nothing is issued for an empty tensor or a world of one: the
    // result is the input, ready on the caller's stream, which stays current.
    c10::OptionalStreamGuard onDone;
    if (!plan.units.empty()) {
      streams_->beginOp(std::move(after));
      const int first = firstStream(plan);
      Prepared prepared;
      {
        // The copy of a view, of an int16 tensor or of coalesced tensors
        // reads the caller's bytes: it waits, on the first step's stream, for
        // what they wait for, and every other stream of the call after it.
        auto onFirst = streams_->enter(first);
        prepared = prepare();
      }
      if (prepared.finish) {
        streams_->restartFrom(first);
      }
      const bool composed = !plan.units.front().direct;
      const int last = composed ? issueComposed(prepared.work, plan, op) : issueDirect(prepared.work, op);
      if (const auto doneStream = streams_->stream(last)) {
        onDone.reset_stream(*doneStream);
      }
      if (prepared.finish) {
        prepared.finish();
      }
      for (const std::vector<at::Tensor>* tensors : {&outputs, &prepared.buffers}) {
        for (const at::Tensor& t : *tensors) {
          streams_->keepAlive(t, last);
        }
      }
      done = streams_->mark(last);
      if (done) {
        inFlight_.add(ranges, done);
      }
    }
    future->markCompleted(c10::IValue(outputs));
  } catch (const std::exception& e) {
    // Some sub-groups may have this operation and others not: the ranks no
    // longer agree on what comes next, so nothing more may be issued.
    failure_ = std::string("fairring: allreduce failed on rank ") + std::to_string(options_.rank) + ": " + e.what();
    throw c10::DistBackendError(failure_);
  }
  const std::string description = "allreduce of " + std::to_string(numel) + " elements of " + dtypeName(dtype) +
      " on rank " + std::to_string(options_.rank);
  return c10::make_intrusive<SubgroupWork>(
      options_.rank, type, std::move(outputs), future, done, device, std::move(parts_), description,
      options_.timeout);
}

void SubgroupAllreduce::countCall(const CallPlan& plan, size_t orderingWaits) {
  ++stats_.operations;
  stats_.orderingWaits += orderingWaits;
  if (stats_.rows.size() < std::max<size_t>(1, options_.plan.size())) {
    stats_.rows.resize(std::max<size_t>(1, options_.plan.size()), 0);
  }
  ++stats_.rows[plan.row];
  if (plan.units.empty()) {
    return;
  }
  if (plan.units.front().direct) {
    ++stats_.ncclCalls;
  } else {
    ++stats_.composedCalls;
  }
}

int SubgroupAllreduce::firstStream(const CallPlan& plan) const {
  const bool composed = !plan.units.front().direct;
  if (composed && options_.localSize > 1) {
    return streams_->reduceScatterStream();
  }
  return static_cast<int>(nextUnit_ % numLanes_);
}

std::vector<c10::intrusive_ptr<c10d::Backend>> SubgroupAllreduce::subgroups(bool withWorld) const {
  std::vector<c10::intrusive_ptr<c10d::Backend>> groups(groups_.lanes.begin(), groups_.lanes.end());
  for (const auto& group : {groups_.localReduce, groups_.localGather}) {
    if (group) {
      groups.push_back(group);
    }
  }
  if (withWorld) {
    groups.push_back(groups_.world);
  }
  return groups;
}

bool SubgroupAllreduce::anySubgroupFailed() const {
  for (const auto& group : subgroups(/*withWorld=*/true)) {
    try {
      if (group->getError() != c10d::ErrorType::SUCCESS) {
        return true;
      }
    } catch (const std::exception&) {
      // A backend that cannot report errors (torch 2.13's Gloo throws "does
      // not support getError") is not known to have failed: the drain still
      // ends at the timeout if its work never finishes.
    }
  }
  return false;
}

void SubgroupAllreduce::awaitIssued() {
  std::vector<DoneEvent> pending;
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure = failure_;
    pending = inFlight_.all();
  }
  if (!failure.empty()) {
    throw c10::DistBackendError(failure + " (barrier on a process group that failed earlier)");
  }
  std::vector<std::function<bool()>> checks;
  for (const auto& event : pending) {
    checks.emplace_back([event] { return event->query(); });
  }
  const DrainEnd end = drainUntil(
      checks, [this] { return aborting_.load() || anySubgroupFailed(); },
      std::chrono::steady_clock::now() + options_.timeout);
  if (end == DrainEnd::kDrained) {
    return;
  }
  throw c10::DistBackendError(
      "fairring: barrier on rank " + std::to_string(options_.rank) + ": " +
      (end == DrainEnd::kFailed
           ? std::string("a sub-group reported an error (or the group was aborted) while its allreduces were finishing")
           : "its allreduces did not finish within " + std::to_string(options_.timeout.count()) + " ms"));
}

void SubgroupAllreduce::shutdown() {
  std::vector<DoneEvent> pending;
  std::string failedEarlier;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) {
      return;
    }
    stopped_ = true;
    pending = inFlight_.all();
    failedEarlier = failure_;
  }
  // Waited for with no lock held: an abort() from another thread is not kept
  // out, and stops the wait.
  DrainEnd end = DrainEnd::kFailed;
  if (failedEarlier.empty()) {
    std::vector<std::function<bool()>> checks;
    for (const auto& event : pending) {
      checks.emplace_back([event] { return event->query(); });
    }
    try {
      end = drainUntil(
          checks, [this] { return aborting_.load() || anySubgroupFailed(); },
          std::chrono::steady_clock::now() + options_.timeout);
    } catch (const std::exception& e) {
      failedEarlier = e.what(); // the device could not say: as good as failed
    }
  }
  if (end == DrainEnd::kDrained) {
    close(/*graceful=*/true, /*withWorld=*/false, "drained");
    return;
  }
  std::string why;
  if (!failedEarlier.empty()) {
    why = "the group had failed (" + failedEarlier + ")";
  } else if (end == DrainEnd::kFailed) {
    why = "a sub-group reported an error while its allreduces were finishing";
  } else {
    why = "its allreduces did not finish within " + std::to_string(options_.timeout.count()) + " ms";
  }
  TORCH_WARN("fairring: destroying rank ", options_.rank, "'s process group: ", why,
             "; its sub-groups, the world group included, were aborted rather than waited for");
  close(/*graceful=*/false, /*withWorld=*/true, std::string("aborted: ") + drainEndName(end));
}

void SubgroupAllreduce::abort() {
  // Takes no lock that an allreduce holds while it issues (on the CPU test
  // path a Gloo collective blocks there), so an abort is never kept waiting.
  aborting_ = true;
  stopped_ = true;
  close(/*graceful=*/false, /*withWorld=*/false, "aborted");
}

void SubgroupAllreduce::close(bool graceful, bool withWorld, const std::string& outcome) {
  {
    std::lock_guard<std::mutex> lock(closeMu_);
    if (closed_) {
      return;
    }
    closed_ = true;
    shutdown_ = outcome;
  }
  // NCCL's graceful shutdown waits for its collectives, and its abort may
  // take a while too: outside the lock, like the wait before it.
  int aborted = 0;
  for (const auto& group : subgroups(withWorld)) {
    try {
      if (graceful) {
        group->shutdown();
      } else {
        group->abort();
        ++aborted;
      }
    } catch (const std::exception& e) {
      TORCH_WARN("fairring: ", graceful ? "shutting down" : "aborting", " a sub-group on rank ", options_.rank,
                 " failed: ", e.what());
    }
  }
  std::lock_guard<std::mutex> lock(closeMu_);
  abortedGroups_ = aborted;
}

SubgroupStats SubgroupAllreduce::stats() const {
  SubgroupStats stats;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats = stats_;
  }
  std::lock_guard<std::mutex> lock(closeMu_);
  stats.shutdown = shutdown_;
  stats.abortedGroups = abortedGroups_;
  return stats;
}

} // namespace fairring
