#include "device/device_path.h"

namespace fairring {

// The collectives a path does not run itself: the delegate's, through delegated().

c10::intrusive_ptr<c10d::Work> DevicePath::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return delegated(tensors, [&](c10d::Backend& b) { return b.allreduce(tensors, opts); }, Callers::kEveryRank, std::nullopt);
}

c10::intrusive_ptr<c10d::Work> DevicePath::allreduceCoalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return delegated(tensors, [&](c10d::Backend& b) { return b.allreduce_coalesced(tensors, opts); }, Callers::kEveryRank, std::nullopt);
}

c10::intrusive_ptr<c10d::Work> DevicePath::reduceScatterBase(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return delegated(tensorsOf(input, output), [&](c10d::Backend& b) { return b._reduce_scatter_base(output, input, opts); }, Callers::kEveryRank, std::nullopt);
}

c10::intrusive_ptr<c10d::Work> DevicePath::reduceScatterList(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return delegated(tensorsOf(outputs, inputs), [&](c10d::Backend& b) { return b.reduce_scatter(outputs, inputs, opts); }, Callers::kEveryRank, std::nullopt);
}

c10::intrusive_ptr<c10d::Work> DevicePath::reduceScatterCoalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return delegated(tensorsOf(inputs, outputs), [&](c10d::Backend& b) {
    return b.reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }, Callers::kEveryRank, std::nullopt);
}

c10::intrusive_ptr<c10d::Work> DevicePath::allGatherBase(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return delegated(tensorsOf(input, output), [&](c10d::Backend& b) { return b._allgather_base(output, input, opts); }, Callers::kEveryRank, std::nullopt);
}

c10::intrusive_ptr<c10d::Work> DevicePath::allGatherList(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return delegated(tensorsOf(inputs, outputs), [&](c10d::Backend& b) { return b.allgather(outputs, inputs, opts); }, Callers::kEveryRank, std::nullopt);
}

c10::intrusive_ptr<c10d::Work> DevicePath::allGatherCoalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return delegated(tensorsOf(inputs, outputs), [&](c10d::Backend& b) {
    return b.allgather_into_tensor_coalesced(outputs, inputs, opts);
  }, Callers::kEveryRank, std::nullopt);
}

} // namespace fairring
