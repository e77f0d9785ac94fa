#include "subgroups/subgroup_allreduce.h"

#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include "faults/fault_points.h"
#include "faults/planted_bugs.h"
#include "faults/plants.h"
#include "ops/reduce_kind.h"
#include "ops/tensor_fusion.h"
#include "subgroups/blocking_wait.h"
#include "subgroups/capture_probe.h"
#include "subgroups/reduction.h"
#include "subgroups/subgroup_work.h"

namespace fairring {

using plants::Plant;
using plants::planted;

SubgroupAllreduce::SubgroupAllreduce(Subgroups groups, SubgroupOptions options, c10::DeviceType deviceType)
    : set_(std::move(groups)),
      groups_(set_.groups()),
      options_(std::move(options)),
      deviceType_(deviceType),
      numLanes_(std::max<int>(1, static_cast<int>(groups_.lanes.size()))),
      ledger_(options_.plan.size(), numLanes_) {
  const BlockingWait blocking = blockingWaitFromEnv();
  TORCH_CHECK(blocking.status.ok(), blocking.status.message());
  blockingWait_ = blocking.on;
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
  // The plan alone says whether calls compose; the rail groups must then exist.
  TORCH_CHECK(!composing || !groups_.lanes.empty(), "fairring: the plan composes calls but no rail groups were made");
  if (!composing) {
    return;
  }
  TORCH_CHECK(M > 1, "fairring: lanes over the rail need several machines");
  TORCH_CHECK(L == 1 || (groups_.localReduce && groups_.localGather),
              "fairring: pieces with several local ranks need the local reduce and gather groups");
  const size_t unit = kPieceAlignment * static_cast<size_t>(L * M);
  TORCH_CHECK(options_.largestPieceBytes > 0 && options_.largestPieceBytes % unit == 0,
              "fairring: the largest piece (", options_.largestPieceBytes, " bytes) must be a multiple of ",
              kPieceAlignment, "*L*M = ", unit);
  const size_t staging = numLanes_ * options_.laneStagingBytes;
  TORCH_CHECK(staging <= options_.totalMemory, "fairring: ", numLanes_, " lanes need ", staging,
              " bytes of staging for pieces of ", options_.largestPieceBytes, " but FAIRRING_TOTAL_MEMORY is ",
              options_.totalMemory);
}

CallCut SubgroupAllreduce::cutFor(int64_t numel, at::ScalarType dtype) const {
  return cutCall(
      numel, c10::elementSize(reductionDtype(dtype)), options_.plan, options_.largestPieceBytes,
      options_.localSize, options_.numMachines);
}

void SubgroupAllreduce::checkTensor(const at::Tensor& t, const std::string& name) const {
  TORCH_CHECK(t.defined(), "fairring: ", name, " is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "fairring: ", name, " has layout ", t.layout(),
              "; allreduce supports dense (strided) tensors only");
  TORCH_CHECK(t.device().type() == deviceType_, "fairring: ", name, " is on ", t.device(), ", expected a ",
              c10::DeviceTypeName(deviceType_, true), " tensor");
}

c10::intrusive_ptr<c10d::Work> SubgroupAllreduce::allreduce(at::Tensor& tensor, RedOp op) {
  checkTensor(tensor, "the allreduce tensor");
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
  return run({tensor}, cutFor(tensor.numel(), tensor.scalar_type()), dtype, op, c10d::OpType::ALLREDUCE, prepare);
}

c10::intrusive_ptr<c10d::Work> SubgroupAllreduce::allreduceCoalesced(std::vector<at::Tensor>& tensors, RedOp op) {
  TORCH_CHECK(!tensors.empty(), "fairring: allreduce_coalesced needs at least one tensor");
  int64_t numel = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    checkTensor(tensors[i], "tensor " + std::to_string(i) + " of allreduce_coalesced");
    numel += tensors[i].numel();
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
  return run(
      tensors, cutFor(numel, tensors[0].scalar_type()), dtype, op, c10d::OpType::ALLREDUCE_COALESCED, prepare);
}

c10::intrusive_ptr<c10d::Work> SubgroupAllreduce::allreduceOnOurStreams(at::Tensor& tensor, RedOp op) {
  checkTensor(tensor, "the allreduce tensor");
  CallCut cut;
  cut.units.push_back(Unit{0, tensor.numel(), true});
  auto prepare = [tensor]() -> Prepared {
    at::Tensor work = tensor.is_contiguous() ? tensor.view({-1}) : tensor.contiguous().view({-1});
    std::function<void()> finish;
    if (!work.is_same(tensor) && !tensor.is_contiguous()) {
      finish = [tensor, work]() mutable { tensor.copy_(work.view(tensor.sizes())); };
    }
    return Prepared{work, std::move(finish), {}};
  };
  return run({tensor}, cut, tensor.scalar_type(), op, c10d::OpType::ALLREDUCE, prepare);
}

void SubgroupAllreduce::countDelegated(size_t row) {
  if (failure_->failed()) {
    throw c10::DistBackendError(failure_->refusal());
  }
  std::unique_lock<std::mutex> lock(mu_);
  ledger_.countDelegated(Held(lock), row);
}

c10::Device SubgroupAllreduce::deviceOf(const std::vector<at::Tensor>& tensors) const {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.device().type() == deviceType_) {
      return t.device();
    }
  }
  return c10::Device(deviceType_);
}

void SubgroupAllreduce::orderBefore(const std::vector<at::Tensor>& tensors) {
  if (planted(Plant::kDelegatedNotAfterAllreduce) || deviceType_ == c10::kCPU) {
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  const Held held(lock);
  InFlightOps<Done>& inFlight = ledger_.inFlight(held);
  const std::vector<ByteRange> ranges = byteRangesOf(tensors);
  if (ranges.empty() || inFlight.size() == 0) {
    return;
  }
  const c10::Device device = deviceOf(tensors);
  if (isCapturing(currentStreamCapture(device))) {
    // Neither ask (a query breaks a global-mode capture) nor wait (an event
    // recorded outside the capture cannot be waited for inside it): the
    // collective is only recorded now, and torch.cuda.graph synchronises the
    // device before it starts capturing.
    if (!inFlight.overlapping(ranges).empty()) {
      ledger_.countUnorderedInCapture(held);
    }
    return;
  }
  inFlight.forget([](const Done& done) { return done->reached(); });
  for (const auto& done : inFlight.overlapping(ranges)) {
    // The delegate orders its own collectives (one stream): only ours are waited for.
    if (std::dynamic_pointer_cast<WorkDone>(done) == nullptr) {
      blockCurrentStream(*done, device);
      ledger_.countOrderingWait(held);
    }
  }
}

void SubgroupAllreduce::orderAfter(const std::vector<at::Tensor>& tensors, const c10::intrusive_ptr<c10d::Work>& work) {
  if (planted(Plant::kAllreduceNotAfterDelegated) || deviceType_ == c10::kCPU) {
    return;
  }
  std::vector<ByteRange> ranges = byteRangesOf(tensors);
  if (ranges.empty() || isCapturing(currentStreamCapture(deviceOf(tensors)))) {
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (planted(Plant::kDelegatedHoldReleasedAtIssue) && streams_ && streams_->onDevice()) {
    plants::releaseDelegateHoldAtIssue(*work, *streams_->stream(0));
  }
  ledger_.inFlight(Held(lock)).add(std::move(ranges), std::make_shared<WorkDone>(work, tensors));
}

void SubgroupAllreduce::useDevice(c10::Device device, std::unique_lock<std::mutex>& lock) {
  // Another thread may be connecting: connecting waits on the host for the
  // peers, so it runs without the lock, which abort() and destroy need.
  connected_.wait(lock, [&] { return life_.load() != Life::kConnecting; });
  if (streams_) {
    TORCH_CHECK(device == streams_->device(), "fairring: an allreduce on ", device,
                " but this process group's allreduces run on ", streams_->device(), "; use one device per process");
    return;
  }
  Life expected = Life::kUnconnected;
  TORCH_CHECK(life_.compare_exchange_strong(expected, Life::kConnecting), "fairring: allreduce on rank ",
              options_.rank, " after the process group was shut down");
  auto streams = std::make_unique<LaneStreams>(device, numLanes_, composes() && options_.localSize > 1);
  std::vector<at::Tensor> staging;
  std::string failure;
  lock.unlock();
  try {
    connect(*streams);
    // Allocated once; each lane reuses its slot piece after piece, in the
    // order of its stream.
    for (int k = 0; composes() && k < numLanes_; ++k) {
      staging.push_back(streams->allocate(options_.laneStagingBytes, k));
    }
  } catch (const std::exception& e) {
    failure = std::string("fairring: rank ") + std::to_string(options_.rank) +
        " could not set up its allreduce sub-groups: " + e.what();
  }
  lock.lock();
  expected = Life::kConnecting;
  const bool up = life_.compare_exchange_strong(expected, failure.empty() ? Life::kReady : Life::kUnconnected);
  connected_.notify_all();
  if (!failure.empty()) {
    failure_->fail(failure, 0); // every later call refuses with it
    throw c10::DistBackendError(failure);
  }
  TORCH_CHECK(up, "fairring: rank ", options_.rank, "'s process group was shut down while it connected");
  streams_ = std::move(streams);
  staging_ = std::move(staging);
}

void SubgroupAllreduce::failAt(uint64_t turn, const std::string& message) {
  failure_->fail(message, turn);
  throw c10::DistBackendError(message);
}

std::vector<Done> SubgroupAllreduce::earlierOverlapping(
    const Held& held,
    const std::vector<ByteRange>& ranges,
    std::vector<at::Tensor>& kept) {
  std::vector<Done> after;
  if (!streams_->onDevice()) {
    return after;
  }
  InFlightOps<Done>& inFlight = ledger_.inFlight(held);
  inFlight.forget([](const Done& done) { return done->reached(); });
  if (!planted(Plant::kByteRangesOff)) {
    after = inFlight.overlapping(ranges);
  }
  for (const Done& point : after) {
    // The caller's stream is current: a delegated call whose future orders
    // nothing is waited for there, before the first step waits for it.
    const auto delegated = std::dynamic_pointer_cast<WorkDone>(point);
    if (delegated && !planted(Plant::kEventlessWorkUnordered) && !delegated->carriesEvents()) {
      for (at::Tensor& t : delegated->blockCallerStream()) {
        kept.push_back(std::move(t));
      }
    }
  }
  return after;
}

c10::intrusive_ptr<c10d::Work> SubgroupAllreduce::run(
    std::vector<at::Tensor> outputs,
    const CallCut& cut,
    at::ScalarType dtype,
    RedOp op,
    c10d::OpType type,
    const std::function<Prepared()>& prepare) {
  TORCH_CHECK(!cut.units.empty(), "fairring: an allreduce of nothing reached the composition");
  const c10::Device device = outputs[0].device();
  std::unique_lock<std::mutex> lock(mu_);
  const Held held(lock); // also after useDevice, which lets go of the lock while it connects
  TORCH_CHECK(!stopped(), "fairring: allreduce on rank ", options_.rank, " after the process group was shut down");
  if (failure_->fails(ledger_.nextTurn(held))) {
    throw c10::DistBackendError(failure_->refusal());
  }
  useDevice(device, lock);
  const uint64_t turn = ledger_.takeTurn(held);
  const std::vector<ByteRange> ranges = byteRangesOf(outputs);
  // Asked before anything is issued, so that an error of the device's here
  // fails this call only, not the group.
  std::vector<at::Tensor> kept; // eventless delegated calls' tensors, waited for through their Work
  std::vector<Done> after = earlierOverlapping(held, ranges, kept);
  ledger_.countCall(held, cut, after.size());
  const std::vector<c10::Device> devices =
      streams_->onDevice() ? std::vector<c10::Device>{device} : std::vector<c10::Device>{};
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devices);
  Event done;
  parts_.clear();
  try {
    // The stream the operation is done on is current while the future is
    // marked: c10's Future records its events on the current stream, and
    // whoever waits on the future (DDP's reducer, then() callbacks) waits for
    // those.
    c10::OptionalStreamGuard onDone;
    streams_->beginOp(std::move(after));
    Prepared prepared;
    const int last = issue(held, cut, op, prepare, prepared, turn);
    if (const auto doneStream = streams_->stream(last)) {
      onDone.reset_stream(*doneStream);
    }
    if (prepared.finish) {
      prepared.finish();
    }
    for (const std::vector<at::Tensor>* tensors : {&outputs, &prepared.buffers, &kept}) {
      for (const at::Tensor& t : *tensors) {
        streams_->keepAlive(t, last);
      }
    }
    done = streams_->mark(last);
    if (done) {
      ledger_.inFlight(held).add(ranges, done);
    }
    if (planted(Plant::kFutureOnCallerStream)) {
      onDone.reset(); // the caller's stream current again
    }
    future->markCompleted(c10::IValue(outputs));
  } catch (const std::exception& e) {
    // Some sub-groups may have this operation and others not: the ranks no
    // longer agree on what comes next, so nothing more may be issued.
    failAt(turn, std::string("fairring: allreduce failed on rank ") + std::to_string(options_.rank) + ": " + e.what());
  }
  const std::string description = "allreduce of " + std::to_string(cut.units.back().begin + cut.units.back().size) +
      " elements of " + dtypeName(dtype) + " on rank " + std::to_string(options_.rank);
  return c10::make_intrusive<SubgroupWork>(
      options_.rank, type, std::move(outputs), future, done, device, std::move(parts_), description,
      options_.timeout, blockingWait_, failure_, set_.abortOnTimeout());
}

int SubgroupAllreduce::issue(
    const Held& held,
    const CallCut& cut,
    RedOp op,
    const std::function<Prepared()>& prepare,
    Prepared& prepared,
    uint64_t turn) {
  faults::hit(faults::kSubgroupsIssue, static_cast<int64_t>(turn)); // a test's failing call
  const int first = firstStream(held, cut);
  {
    // The copy of a view, of an int16 tensor or of coalesced tensors reads
    // the caller's bytes: it waits, on the first step's stream, for what they
    // wait for, and every other stream of the call after it.
    auto onFirst = streams_->enter(first);
    prepared = prepare();
  }
  if (prepared.finish) {
    streams_->restartFrom(first);
  }
  const bool composed = !cut.units.front().direct;
  if (composed) {
    return issueComposed(held, prepared.work, cut, op);
  }
  ledger_.countUnits(held, /*direct=*/1, /*sliced=*/0);
  return issueDirect(held, prepared.work, op);
}

int SubgroupAllreduce::firstStream(const Held& held, const CallCut& cut) const {
  const bool composed = !cut.units.front().direct;
  if (composed && options_.localSize > 1) {
    return streams_->reduceScatterStream();
  }
  return ledger_.nextLane(held);
}

SubgroupStats SubgroupAllreduce::stats() const {
  SubgroupStats stats;
  {
    std::unique_lock<std::mutex> lock(mu_);
    static_cast<CallCounts&>(stats) = ledger_.counts(Held(lock));
    stats.eventsCreated = streams_ ? streams_->eventsCreated() : 0;
  }
  stats.closed = set_.closed();
  return stats;
}

} // namespace fairring
