#include "vehicle_gloo.h"

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <functional>
#include <memory>
#include <utility>

#include "vehicle_device.h"

namespace vehicle {

namespace {

c10::Stream current() {
  return c10::impl::VirtualGuardImpl(device().type()).getStream(device());
}

// A Gloo work on device tensors: `copyBack` (if any) runs in wait(), on the
// current stream; the end of what ran at issue is `end`. The reduce-scatter's
// (a LambdaWork in ProcessGroupGloo.cpp) has no future, as there.
class GlooWork : public c10d::Work {
 public:
  GlooWork(c10::Event end, std::vector<at::Tensor> outputs, std::function<void()> copyBack)
      : end_(std::move(end)), outputs_(std::move(outputs)), copyBack_(std::move(copyBack)) {
    if (!copyBack_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device()});
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

  bool isCompleted() override {
    return end_.query();
  }
  void synchronize() override {
    end_.block(current());
  }
  bool wait(std::chrono::milliseconds) override {
    synchronize();
    if (copyBack_) {
      std::function<void()> copy;
      std::swap(copy, copyBack_);
      copy();
    }
    return true;
  }
  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    TORCH_CHECK(future_, "Work::getFuture not implemented (ProcessGroupGloo's reduce-scatter of device tensors)");
    return future_;
  }

 private:
  c10::Event end_;
  std::vector<at::Tensor> outputs_;
  std::function<void()> copyBack_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace

GlooOnVehicle::GlooOnVehicle(c10::intrusive_ptr<c10d::Backend> gloo, std::string name)
    : c10d::Backend(gloo->getRank(), gloo->getSize()),
      gloo_(std::move(gloo)),
      name_(std::move(name)),
      stream_(newStream("Gloo's copy stream of " + name_).id()) {}

c10::Stream GlooOnVehicle::copyStream() const {
  const c10::Stream copies(c10::Stream::UNSAFE, device(), stream_);
  c10::Event issued(device().type());
  issued.record(current());
  issued.block(copies);
  return copies;
}

c10::intrusive_ptr<c10d::Work> GlooOnVehicle::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  const c10::Stream copies = copyStream();
  c10::StreamGuard onCopies(copies);
  std::vector<at::Tensor> host;
  for (const at::Tensor& t : tensors) {
    host.push_back(hostView(t).clone());
  }
  recordLaunch(name_ + ": copy to host (allreduce)", tensors, {});
  gloo_->allreduce(host, opts)->wait();
  for (size_t i = 0; i < tensors.size(); ++i) {
    hostView(tensors[i]).copy_(host[i]);
  }
  recordLaunch(name_ + ": copy back (allreduce)", {}, tensors);
  c10::Event end(device().type());
  end.record(copies);
  return c10::make_intrusive<GlooWork>(std::move(end), tensors, nullptr);
}

c10::intrusive_ptr<c10d::Work> GlooOnVehicle::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  const c10::Stream copies = copyStream();
  c10::StreamGuard onCopies(copies);
  at::Tensor in = hostView(input).clone();
  at::Tensor out = at::empty(output.sizes(), in.options());
  recordLaunch(name_ + ": copy to host (all-gather)", {input}, {});
  gloo_->_allgather_base(out, in, opts)->wait();
  hostView(output).copy_(out);
  recordLaunch(name_ + ": copy back (all-gather)", {}, {output});
  c10::Event end(device().type());
  end.record(copies);
  return c10::make_intrusive<GlooWork>(std::move(end), std::vector<at::Tensor>{output}, nullptr);
}

c10::intrusive_ptr<c10d::Work> GlooOnVehicle::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  const c10::Stream copies = copyStream();
  c10::StreamGuard onCopies(copies);
  at::Tensor in = hostView(input).clone();
  at::Tensor out = at::empty(output.sizes(), in.options());
  recordLaunch(name_ + ": copy to host (reduce-scatter)", {input}, {});
  gloo_->_reduce_scatter_base(out, in, opts)->wait();
  c10::Event end(device().type());
  end.record(copies);
  // The output is written in wait(), on the stream current there, after it
  // waited for the copies' end.
  at::Tensor target = output;
  std::string name = name_;
  auto copyBack = [target, out, name]() mutable {
    recordLaunch(name + ": copy back in wait() (reduce-scatter)", {}, {target});
    hostView(target).copy_(out);
  };
  return c10::make_intrusive<GlooWork>(std::move(end), std::vector<at::Tensor>{output}, std::move(copyBack));
}

c10::intrusive_ptr<c10d::Work> GlooOnVehicle::barrier(const c10d::BarrierOptions& opts) {
  return gloo_->barrier(opts);
}

void GlooOnVehicle::shutdown() {
  gloo_->shutdown();
}

void GlooOnVehicle::abort() {
  gloo_->abort();
}

} // namespace vehicle
