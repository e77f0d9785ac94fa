#include "vehicle_backend.h"

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdlib>
#include <cstring>

#include "vehicle_device.h"

namespace vehicle {

namespace {

c10::Stream current() {
  return c10::impl::VirtualGuardImpl(device().type()).getStream(device());
}

std::vector<at::Tensor> hostViews(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views;
  for (const at::Tensor& t : tensors) {
    views.push_back(onVehicle(t) ? hostView(t) : t);
  }
  return views;
}

void checkAll(const std::vector<at::Tensor>& tensors, const std::string& op) {
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(onVehicle(t), "vehicle: ", op, " on a tensor on ", t.device(), "; the group takes vehicle tensors");
    // ProcessGroupNCCL's own check (check_gpu_single_tensor), with its words.
    TORCH_CHECK_VALUE(t.is_contiguous(t.suggest_memory_format()), "Tensors must be contiguous");
  }
}

bool blockingWaitFromEnv() {
  const char* value = std::getenv("TORCH_NCCL_BLOCKING_WAIT");
  return value != nullptr && (std::strcmp(value, "1") == 0 || std::strcmp(value, "true") == 0);
}

// ProcessGroupNCCL's Work as far as streams and memory go.
class StreamedWork : public c10d::Work {
 public:
  StreamedWork(
      c10::Event end,
      Clock endClock,
      std::vector<at::Tensor> outputs,
      c10::intrusive_ptr<c10::ivalue::Future> future,
      std::shared_ptr<Shelf> shelf,
      bool blockingWait)
      : end_(std::move(end)),
        endClock_(std::move(endClock)),
        outputs_(std::move(outputs)),
        future_(std::move(future)),
        shelf_(std::move(shelf)),
        blockingWait_(blockingWait) {}

  bool isCompleted() override {
    return end_.query();
  }
  bool isSuccess() const override {
    return true;
  }
  // The caller's current stream waits for the end; then, and only then, the
  // shelf may go (ProcessGroupNCCL::WorkNCCL::synchronizeStream).
  void synchronize() override {
    end_.block(current());
    shelf_->unstash();
  }
  bool wait(std::chrono::milliseconds timeout) override {
    synchronize();
    if (blockingWait_ || timeout != kNoTimeout) {
      Ledger::get().hostKnows(endClock_);
    }
    return true;
  }
  void blockCurrentStream() override {
    synchronize();
  }
  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  c10::Event end_;
  Clock endClock_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<Shelf> shelf_;
  bool blockingWait_;
};

} // namespace

void Shelf::stash(const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(mu_);
  tensors_.insert(tensors_.end(), tensors.begin(), tensors.end());
}

void Shelf::unstash() {
  std::vector<at::Tensor> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(tensors_);
  }
}

bool isStreamedWork(const c10::intrusive_ptr<c10d::Work>& work) {
  return dynamic_cast<StreamedWork*>(work.get()) != nullptr;
}

StreamedBackend::StreamedBackend(c10::intrusive_ptr<c10d::Backend> gloo, std::string name)
    : c10d::Backend(gloo->getRank(), gloo->getSize()),
      gloo_(std::move(gloo)),
      name_(std::move(name)),
      stream_(newStream("communication stream of " + name_).id()),
      blockingWait_(blockingWaitFromEnv()) {}

void StreamedBackend::releaseEnded() {
  std::vector<std::shared_ptr<Shelf>> ended;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto still = watched_.begin();
    for (auto& w : watched_) {
      if (Ledger::get().hostKnowsDone(w.end)) {
        ended.push_back(std::move(w.shelf));
      } else {
        *still++ = std::move(w);
      }
    }
    watched_.erase(still, watched_.end());
  }
  for (const auto& shelf : ended) {
    shelf->unstash();
  }
}

void StreamedBackend::launch(
    const c10::Stream& stream,
    const std::string& op,
    const std::vector<at::Tensor>& reads,
    const std::vector<at::Tensor>& writes,
    const std::function<void()>& onHost) {
  // NCCL runs one communicator's kernels one after the other, whichever
  // streams they were issued on.
  std::lock_guard<std::mutex> lock(launchMu_);
  previous_.block(stream);
  c10::StreamGuard onStream(stream);
  recordLaunch(name_ + ": " + op, reads, writes);
  onHost();
  previous_.record(stream);
}

size_t StreamedBackend::heldShelves() {
  std::lock_guard<std::mutex> lock(mu_);
  return watched_.size();
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::run(
    const std::string& op,
    bool async,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& temporaries,
    const std::function<void()>& onHost) {
  checkAll(inputs, op);
  checkAll(outputs, op);
  releaseEnded();
  ++collectives_;
  std::vector<at::Tensor> writes(outputs);
  writes.insert(writes.end(), temporaries.begin(), temporaries.end());
  if (!async) {
    // On the caller's current stream, which orders everything: nothing to hold.
    launch(current(), op, inputs, writes, onHost);
    return c10::intrusive_ptr<c10d::Work>();
  }
  const c10::Stream comm(c10::Stream::UNSAFE, device(), stream_);
  c10::Event issued(device().type());
  issued.record(current());
  issued.block(comm);
  launch(comm, op, inputs, writes, onHost);
  c10::Event end(device().type());
  end.record(comm);
  Clock endClock = Ledger::get().clockOf(stream_);
  auto shelf = std::make_shared<Shelf>();
  shelf->stash(inputs);
  shelf->stash(writes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    watched_.push_back(Watched{endClock, shelf});
  }
  auto future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device()});
  {
    c10::StreamGuard onComm(comm);
    future->markCompleted(c10::IValue(outputs));
  }
  return c10::make_intrusive<StreamedWork>(
      std::move(end), std::move(endClock), outputs, future, std::move(shelf), blockingWait_);
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return run("allreduce", opts.asyncOp, tensors, tensors, {}, [&] {
    auto views = hostViews(tensors);
    // NCCL averages; Gloo does not: a sum, divided in the same launch.
    const bool average = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
    c10d::AllreduceOptions summed = opts;
    if (average) {
      summed.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    }
    gloo_->allreduce(views, summed)->wait();
    if (average) {
      for (at::Tensor& view : views) {
        view.div_(getSize());
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return run("allreduce_coalesced", opts.asyncOp, tensors, tensors, {}, [&] {
    auto views = hostViews(tensors);
    gloo_->allreduce_coalesced(views, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return run("broadcast", opts.asyncOp, tensors, tensors, {}, [&] {
    auto views = hostViews(tensors);
    gloo_->broadcast(views, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == 1, "vehicle: allgather takes one list of outputs");
  return run("allgather", opts.asyncOp, inputs, outputs[0], {}, [&] {
    std::vector<std::vector<at::Tensor>> outs{hostViews(outputs[0])};
    auto ins = hostViews(inputs);
    gloo_->allgather(outs, ins, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return run("all-gather", opts.asyncOp, {input}, {output}, {}, [&] {
    at::Tensor out = hostView(output);
    at::Tensor in = hostView(input);
    gloo_->_allgather_base(out, in, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1, "vehicle: reduce_scatter takes one output and one list");
  checkAll(inputs[0], "reduce_scatter");
  // As ProcessGroupNCCL: the inputs are copied into one flat temporary, made
  // on the caller's stream and filled on the stream the collective runs on;
  // only the Work's shelf holds it.
  at::Tensor flat = at::empty({static_cast<int64_t>(inputs[0].size()) * outputs[0].numel()}, outputs[0].options());
  at::Tensor& output = outputs[0];
  return run("reduce_scatter (list)", opts.asyncOp, inputs[0], {output}, {flat}, [&] {
    at::Tensor host = hostView(flat);
    int64_t offset = 0;
    for (const at::Tensor& t : inputs[0]) {
      host.narrow(0, offset, t.numel()).copy_(hostView(t).reshape({-1}));
      offset += t.numel();
    }
    at::Tensor out = hostView(output);
    gloo_->_reduce_scatter_base(out, host, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return run("reduce-scatter", opts.asyncOp, {input}, {output}, {}, [&] {
    at::Tensor out = hostView(output);
    at::Tensor in = hostView(input);
    gloo_->_reduce_scatter_base(out, in, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  return run("all-to-all", opts.asyncOp, {input}, {output}, {}, [&] {
    at::Tensor out = hostView(output);
    at::Tensor in = hostView(input);
    gloo_->alltoall_base(out, in, outputSplitSizes, inputSplitSizes, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::barrier(const c10d::BarrierOptions& opts) {
  // ProcessGroupNCCL's barrier is an allreduce on the communicator, after its
  // earlier collectives, whose wait() blocks the host: here the host learns
  // at once that the device got that far.
  gloo_->barrier(opts)->wait();
  auto work = run("barrier", true, {}, {}, {}, [] {});
  Ledger::get().hostKnowsStream(stream_);
  return work;
}

void StreamedBackend::shutdown() {
  gloo_->shutdown();
}

void StreamedBackend::abort() {
  gloo_->abort();
}

} // namespace vehicle
