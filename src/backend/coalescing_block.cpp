#include "backend/coalescing_block.h"

#include <c10/util/Exception.h>

namespace fairring {

namespace {

// The end of a block whose calls ran one by one: done when all of them are.
class BlockWork : public c10d::Work {
 public:
  explicit BlockWork(std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : c10d::Work(-1, c10d::OpType::COALESCED), works_(std::move(works)) {}

  bool isCompleted() override {
    for (const auto& w : works_) {
      if (!w->isCompleted()) {
        return false;
      }
    }
    return true;
  }
  bool isSuccess() const override {
    for (const auto& w : works_) {
      if (!w->isSuccess()) {
        return false;
      }
    }
    return true;
  }
  std::exception_ptr exception() const override {
    for (const auto& w : works_) {
      if (auto e = w->exception()) {
        return e;
      }
    }
    return nullptr;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (const auto& w : works_) {
      w->wait(timeout);
    }
    return true;
  }
  void synchronize() override {
    for (const auto& w : works_) {
      w->synchronize();
    }
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

} // namespace

CoalescingBlock::CoalescingBlock(c10::DeviceType acceleratorType, c10::intrusive_ptr<c10d::Backend> accelerator)
    : acceleratorType_(acceleratorType), accelerator_(std::move(accelerator)) {}

bool CoalescingBlock::supported() const {
  return accelerator_ && accelerator_->supportsCoalescing();
}

void CoalescingBlock::start() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(state_ == State::kClosed, "fairring: start_coalescing inside a coalescing block");
  state_ = State::kOpen;
}

void CoalescingBlock::enter(c10::DeviceType device) {
  std::lock_guard<std::mutex> lock(mu_);
  switch (state_) {
    case State::kClosed:
      return;
    case State::kOpen:
      if (device == acceleratorType_ && supported()) {
        accelerator_->startCoalescing();
        state_ = State::kOnDelegate;
      } else {
        state_ = State::kOneByOne;
      }
      return;
    case State::kOnDelegate:
      TORCH_CHECK(
          device == acceleratorType_, "fairring: a coalescing block of ", c10::DeviceTypeName(acceleratorType_, true),
          " tensors has a call on ", c10::DeviceTypeName(device, true), " tensors; one block, one device");
      return;
    case State::kOneByOne:
      TORCH_CHECK(
          device != acceleratorType_ || !supported(), "fairring: a coalescing block of CPU tensors has a call on ",
          c10::DeviceTypeName(device, true), " tensors; one block, one device");
      return;
  }
}

void CoalescingBlock::keep(const c10::intrusive_ptr<c10d::Work>& work, const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == State::kOneByOne && work) {
    kept_.push_back(work);
  }
  if (state_ == State::kOnDelegate) {
    tensors_.insert(tensors_.end(), tensors.begin(), tensors.end());
  }
}

c10::intrusive_ptr<c10d::Work> CoalescingBlock::end(const Order& ordered) {
  State was;
  std::vector<c10::intrusive_ptr<c10d::Work>> kept;
  std::vector<at::Tensor> tensors;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(state_ != State::kClosed, "fairring: end_coalescing without start_coalescing");
    was = state_;
    kept.swap(kept_);
    tensors.swap(tensors_);
    state_ = State::kClosed;
  }
  switch (was) {
    case State::kOnDelegate:
      return ordered(tensors, [this] { return accelerator_->endCoalescing(); });
    case State::kOneByOne:
      return c10::make_intrusive<BlockWork>(std::move(kept));
    case State::kOpen:
    case State::kClosed:
      break;
  }
  return c10::intrusive_ptr<c10d::Work>(); // an empty block, as ProcessGroupNCCL's
}

bool CoalescingBlock::open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_ != State::kClosed;
}

} // namespace fairring
