#include "vehicle_device.h"

#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceType.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>

namespace vehicle {

namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
constexpr int64_t kDefaultStream = 0;
// As CUDA's pool: a fixed number of streams handed out round robin.
constexpr int64_t kPoolSize = 32;
constexpr int64_t kPoolBase = 1; // normal priority: 1..32, high: 33..64
constexpr int64_t kNewBase = 1000; // streams of their own

thread_local int64_t tCurrent = kDefaultStream;
std::atomic<int64_t> nextPool{0};
std::atomic<int64_t> nextHighPool{0};
std::atomic<int64_t> nextNew{kNewBase};

c10::Stream streamOf(int64_t id) {
  return c10::Stream(c10::Stream::UNSAFE, device(), id);
}

// ------------------------------------------------------------------ events

struct EventState {
  Clock clock;
  int asked{0}; // queries answered "not yet" since it was recorded
  // When it was recorded, on the host: what a timing event's elapsed time
  // reads (the vehicle runs kernels at once, so the host's time is theirs).
  std::chrono::steady_clock::time_point recorded;
};

// ---------------------------------------------------------------- the guard

struct Guard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kType;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    checkIndex(d);
    return device();
  }
  c10::Device getDevice() const override {
    return device();
  }
  void setDevice(c10::Device d) const override {
    checkIndex(d);
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override {
    return streamOf(tCurrent);
  }
  c10::Stream getDefaultStream(c10::Device) const override {
    return streamOf(kDefaultStream);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool isHighPriority) const override {
    auto& counter = isHighPriority ? nextHighPool : nextPool;
    const int64_t base = kPoolBase + (isHighPriority ? kPoolSize : 0);
    const int64_t id = base + counter.fetch_add(1) % kPoolSize;
    Ledger::get().nameStream(id, std::string(isHighPriority ? "high-priority " : "") + "pool stream");
    return streamOf(id);
  }
  // As CUDA's (CUDAGuardImpl::getNewStream is getStreamFromPool): a pool
  // stream, which the program may be handed too. A stream of one's own is
  // newStream's (as cudaStreamCreate's).
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return getStreamFromGlobalPool(d, priority < 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const int64_t previous = tCurrent;
    tCurrent = s.id();
    return streamOf(previous);
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return 1;
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) {
      *event = new EventState();
    }
    auto* state = static_cast<EventState*>(*event);
    state->clock = Ledger::get().clockOf(stream.id());
    state->asked = 0;
    state->recorded = std::chrono::steady_clock::now();
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start != nullptr && end != nullptr, "vehicle: elapsedTime of an event never recorded");
    const auto* a = static_cast<EventState*>(start);
    const auto* b = static_cast<EventState*>(end);
    return std::chrono::duration<double, std::milli>(b->recorded - a->recorded).count();
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event != nullptr) { // an event never recorded orders nothing, as on CUDA
      Ledger::get().wait(stream.id(), static_cast<EventState*>(event)->clock);
    }
  }
  bool queryEvent(void* event) const override {
    if (event == nullptr) {
      return true;
    }
    auto* state = static_cast<EventState*>(event);
    return Ledger::get().reached(state->clock, state->asked);
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<EventState*>(event);
  }
  bool queryStream(const c10::Stream& stream) const override {
    int asked = 0;
    return Ledger::get().reached(Ledger::get().clockOf(stream.id()), asked);
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    Ledger::get().hostKnowsStream(stream.id());
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) {
      Ledger::get().hostKnows(static_cast<EventState*>(event)->clock);
    }
  }
  void synchronizeDevice(const c10::DeviceIndex) const override {
    Ledger::get().hostKnowsAll();
  }
  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& stream) const override;

 private:
  static void checkIndex(c10::Device d) {
    TORCH_CHECK(!d.has_index() || d.index() == 0, "vehicle: there is one vehicle device, not ", d);
  }
};

// ------------------------------------------------------------ the allocator

// A block of the vehicle's memory: which stream allocated it and which
// streams the allocator was told it is used on (CUDA's caching allocator
// hands a freed block to later allocations on its own stream at once, and to
// others only once the recorded streams are past the free).
struct Block {
  void* ptr{nullptr};
  size_t bytes{0};
  int64_t stream{0};
  std::mutex mu;
  std::set<int64_t> recordedOn;
};

void freeBlock(void* context) {
  auto* block = static_cast<Block*>(context);
  const auto begin = reinterpret_cast<uintptr_t>(block->ptr);
  std::set<int64_t> recorded;
  {
    std::lock_guard<std::mutex> lock(block->mu);
    recorded = block->recordedOn;
  }
  Ledger::get().released(begin, begin + block->bytes, block->stream, recorded);
  std::free(block->ptr);
  delete block;
}

struct Allocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    auto* block = new Block();
    block->bytes = bytes;
    block->stream = tCurrent;
    if (bytes > 0) {
      block->ptr = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
      TORCH_CHECK(block->ptr != nullptr, "vehicle: out of memory allocating ", bytes, " bytes");
    }
    return {block->ptr, block, &freeBlock, device()};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

Allocator gAllocator;

void Guard::recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& stream) const {
  if (data.get_deleter() != &freeBlock) {
    return;
  }
  auto* block = static_cast<Block*>(data.get_context());
  std::lock_guard<std::mutex> lock(block->mu);
  if (stream.id() != block->stream) {
    block->recordedOn.insert(stream.id());
  }
}

// ---------------------------------------------------------------- kernels

c10::DispatchKeySet keys() {
  return c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
}

at::Tensor emptyMemoryFormat(
    c10::IntArrayRef size,
    std::optional<at::ScalarType> dtype,
    std::optional<at::Layout>,
    std::optional<at::Device>,
    std::optional<bool>,
    std::optional<at::MemoryFormat> memoryFormat) {
  return at::detail::empty_generic(size, &gAllocator, keys(), c10::dtype_or_default(dtype), memoryFormat);
}

at::Tensor emptyStrided(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<at::ScalarType> dtype,
    std::optional<at::Layout>,
    std::optional<at::Device>,
    std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, &gAllocator, keys(), c10::dtype_or_default(dtype));
}

// Copies to, from and within the device: one launch on the current stream; a
// copy to the host waits for it (non_blocking=False), as on CUDA.
at::Tensor copyFrom(const at::Tensor& self, const at::Tensor& dst, bool nonBlocking) {
  std::vector<at::Tensor> reads;
  std::vector<at::Tensor> writes;
  if (onVehicle(self)) {
    reads.push_back(self);
  }
  if (onVehicle(dst)) {
    writes.push_back(dst);
  }
  recordLaunch(onVehicle(dst) ? (onVehicle(self) ? "copy" : "copy from host") : "copy to host", reads, writes);
  at::Tensor to = onVehicle(dst) ? hostView(dst) : dst;
  to.copy_(onVehicle(self) ? hostView(self) : self);
  if (!onVehicle(dst) && !nonBlocking) {
    Ledger::get().hostKnowsStream(tCurrent);
  }
  return dst;
}

at::Scalar localScalarDense(const at::Tensor& self) {
  recordLaunch("item", {self}, {});
  Ledger::get().hostKnowsStream(tCurrent);
  return at::_local_scalar_dense(hostView(self));
}

void recordStream(at::Tensor& self, c10::Stream stream) {
  recordOnStream(self, stream);
}

const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat>) {
  int64_t numel = 1;
  for (int64_t s : size) {
    numel *= s;
  }
  const size_t needed = (self.storage_offset() + numel) * self.element_size();
  TORCH_CHECK(
      needed <= self.storage().nbytes(), "vehicle: resize_ would grow a tensor's storage (", self.storage().nbytes(),
      " to ", needed, " bytes), which the vehicle does not do");
  self.unsafeGetTensorImpl()->set_sizes_contiguous(size);
  return self;
}

// Every other operator: its CPU kernel on host views of the vehicle tensors,
// recorded as one launch on the current stream. Arguments the schema marks
// as written are the launch's writes, other vehicle tensors its reads, and a
// new tensor it returns is copied into vehicle memory (also a write).
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t first = stack->size() - arguments.size();
  std::vector<at::Tensor> reads;
  std::vector<at::Tensor> writes;
  std::vector<at::Tensor> written(arguments.size());
  bool any = false;
  auto convert = [&](const at::Tensor& t, bool write) -> at::Tensor {
    if (!onVehicle(t)) {
      return t;
    }
    any = true;
    (write ? writes : reads).push_back(t);
    return hostView(t);
  };
  for (size_t i = 0; i < arguments.size(); ++i) {
    c10::IValue& value = (*stack)[first + i];
    const bool write = arguments[i].alias_info() != nullptr && arguments[i].alias_info()->isWrite();
    if (value.isTensor()) {
      const at::Tensor t = value.toTensor();
      if (write) {
        written[i] = t;
      }
      value = convert(t, write);
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> list = value.toTensorList();
      c10::List<at::Tensor> host;
      for (const at::Tensor& t : list) {
        host.push_back(convert(t, write));
      }
      value = host;
    } else if (value.isDevice() && value.toDevice().type() == kType) {
      any = true;
      value = c10::Device(c10::kCPU);
    }
  }
  op.callBoxed(stack);
  const auto& returns = schema.returns();
  for (size_t j = 0; j < returns.size(); ++j) {
    c10::IValue& value = (*stack)[first + j];
    const c10::AliasInfo* alias = returns[j].alias_info();
    if (alias != nullptr) {
      TORCH_CHECK(alias->isWrite(), "vehicle: ", schema.name(), " returns a view; register a kernel for it");
      for (size_t i = 0; i < arguments.size(); ++i) {
        const c10::AliasInfo* from = arguments[i].alias_info();
        if (from != nullptr && from->beforeSets() == alias->beforeSets() && written[i].defined()) {
          value = written[i];
        }
      }
      continue;
    }
    if (!any || !value.isTensor() || !value.toTensor().defined()) {
      continue;
    }
    const at::Tensor result = value.toTensor();
    at::Tensor made = at::empty_strided(result.sizes(), result.strides(), result.options().device(device()));
    hostView(made).copy_(result);
    writes.push_back(made);
    value = made;
  }
  if (any) {
    recordLaunch(schema.name(), reads, writes);
  }
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", emptyMemoryFormat);
  m.impl("empty_strided", emptyStrided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("_copy_from", copyFrom);
  m.impl("_local_scalar_dense", localScalarDense);
  m.impl("record_stream", recordStream);
  m.impl("resize_", resize);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// What torch asks an accelerator (torch.accelerator, dist.barrier()'s device).
struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return 1;
  }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex getCurrentDevice() const override {
    return 0;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override {
    return 0;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override {
    return 0;
  }
  at::Device getDeviceFromPtr(void*) const override {
    return device();
  }
};

} // namespace

c10::Device device() {
  return c10::Device(kType, 0);
}

bool onVehicle(const at::Tensor& t) {
  return t.defined() && t.device().type() == kType;
}

Touch touchOf(const at::Tensor& t, bool write) {
  Touch touch;
  touch.write = write;
  if (!t.defined() || t.numel() == 0) {
    return touch;
  }
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    last += (t.size(d) - 1) * t.stride(d);
  }
  touch.begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  touch.end = touch.begin + static_cast<uintptr_t>((last + 1) * t.element_size());
  std::ostringstream what;
  what << "a tensor of " << t.numel() << " " << t.scalar_type() << " at 0x" << std::hex << touch.begin;
  touch.what = what.str();
  return touch;
}

int64_t currentStream() {
  return tCurrent;
}

c10::Stream newStream(const std::string& name) {
  const int64_t id = nextNew.fetch_add(1);
  Ledger::get().nameStream(id, name);
  return streamOf(id);
}

at::Tensor hostView(const at::Tensor& t) {
  if (t.numel() == 0) {
    return at::empty(t.sizes(), t.options().device(c10::kCPU));
  }
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::kCPU));
}

uint64_t recordLaunchOn(
    int64_t stream,
    const std::string& op,
    const std::vector<at::Tensor>& reads,
    const std::vector<at::Tensor>& writes) {
  std::vector<Touch> touches;
  for (const at::Tensor& t : reads) {
    touches.push_back(touchOf(t, false));
  }
  for (const at::Tensor& t : writes) {
    touches.push_back(touchOf(t, true));
  }
  return Ledger::get().launch(stream, op, std::move(touches));
}

uint64_t recordLaunch(const std::string& op, const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes) {
  return recordLaunchOn(tCurrent, op, reads, writes);
}

void recordOnStream(const at::Tensor& t, const c10::Stream& stream) {
  if (onVehicle(t) && t.has_storage()) {
    Guard().recordDataPtrOnStream(t.storage().data_ptr(), stream);
  }
}

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::register_privateuse1_backend("vehicle");
    c10::SetAllocator(kType, &gAllocator);
    at::RegisterPrivateUse1HooksInterface(new Hooks());
    Ledger::get().nameStream(kDefaultStream, "default stream");
  });
}

} // namespace vehicle
