#include "vehicle_backend.h"

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

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
  }
}

// ProcessGroupNCCL's Work as far as streams go: the host never waits.
class StreamedWork : public c10d::Work {
 public:
  StreamedWork(c10::Event end, std::vector<at::Tensor> outputs, c10::intrusive_ptr<c10::ivalue::Future> future)
      : end_(std::move(end)), outputs_(std::move(outputs)), future_(std::move(future)) {}

  bool isCompleted() override {
    return end_.query();
  }
  bool isSuccess() const override {
    return true;
  }
  void synchronize() override {
    end_.block(current());
  }
  bool wait(std::chrono::milliseconds) override {
    synchronize();
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
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace

StreamedBackend::StreamedBackend(c10::intrusive_ptr<c10d::Backend> gloo, std::string name)
    : c10d::Backend(gloo->getRank(), gloo->getSize()),
      gloo_(std::move(gloo)),
      name_(std::move(name)),
      stream_(newStream("communication stream of " + name_).id()) {}

c10::intrusive_ptr<c10d::Work> StreamedBackend::run(
    const std::string& op,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    const std::function<void()>& onHost) {
  checkAll(inputs, op);
  checkAll(outputs, op);
  ++collectives_;
  const c10::Stream comm(c10::Stream::UNSAFE, device(), stream_);
  c10::Event issued(device().type());
  issued.record(current());
  issued.block(comm);
  for (const auto* set : {&inputs, &outputs}) {
    for (const at::Tensor& t : *set) {
      recordOnStream(t, comm);
    }
  }
  recordLaunchOn(stream_, name_ + ": " + op, inputs, outputs);
  onHost();
  c10::Event end(device().type());
  end.record(comm);
  auto future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device()});
  {
    c10::StreamGuard onComm(comm);
    future->markCompleted(c10::IValue(outputs));
  }
  return c10::make_intrusive<StreamedWork>(std::move(end), outputs, future);
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return run("allreduce", tensors, tensors, [&] {
    auto views = hostViews(tensors);
    gloo_->allreduce(views, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return run("allreduce_coalesced", tensors, tensors, [&] {
    auto views = hostViews(tensors);
    gloo_->allreduce_coalesced(views, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return run("broadcast", tensors, tensors, [&] {
    auto views = hostViews(tensors);
    gloo_->broadcast(views, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == 1, "vehicle: allgather takes one list of outputs");
  return run("allgather", inputs, outputs[0], [&] {
    std::vector<std::vector<at::Tensor>> outs{hostViews(outputs[0])};
    auto ins = hostViews(inputs);
    gloo_->allgather(outs, ins, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return run("all-gather", {input}, {output}, [&] {
    at::Tensor out = hostView(output);
    at::Tensor in = hostView(input);
    gloo_->_allgather_base(out, in, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return run("reduce-scatter", {input}, {output}, [&] {
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
  return run("all-to-all", {input}, {output}, [&] {
    at::Tensor out = hostView(output);
    at::Tensor in = hostView(input);
    gloo_->alltoall_base(out, in, outputSplitSizes, inputSplitSizes, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::barrier(const c10d::BarrierOptions& opts) {
  // ProcessGroupNCCL's barrier is an allreduce whose wait() blocks the host.
  gloo_->barrier(opts)->wait();
  return run("barrier", {}, {}, [] {});
}

void StreamedBackend::shutdown() {
  gloo_->shutdown();
}

void StreamedBackend::abort() {
  gloo_->abort();
}

} // namespace vehicle
