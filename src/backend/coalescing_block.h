#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace fairring {

// A coalescing block (torch's _coalescing_manager with a device, which
// batch_isend_irecv uses): start_coalescing, the calls, end_coalescing, on the
// calling thread. c10d hands the block to the backend of the device without
// saying which device to fairring, whose one backend serves CPU and the
// accelerator; the block's first call says. Its calls then go to that
// device's delegate inside the delegate's own block where it has one (NCCL
// groups them: a ring of sends and receives one by one would deadlock on
// NCCL's communicator creation), or one by one (Gloo has no blocks), the end
// returning one Work over all of them. No call of a block composes: NCCL's
// group is open on the thread while it lasts.
class CoalescingBlock {
 public:
  // The block's life, one value.
  enum class State : uint8_t {
    kClosed, // no block
    kOpen, // started, no call yet
    kOnDelegate, // the accelerator delegate's block is open
    kOneByOne, // the calls run one by one; their Works are kept for the end
  };

  // `accelerator`: the accelerator's delegate (null without one).
  CoalescingBlock(c10::DeviceType acceleratorType, c10::intrusive_ptr<c10d::Backend> accelerator);

  // Whether fairring takes blocks: where the accelerator's delegate does.
  bool supported() const;
  void start();
  // A call of the block on `device`'s tensors, before it is issued: opens the
  // delegate's block at the first call on the accelerator. Raises for a block
  // that mixes devices.
  void enter(c10::DeviceType device);
  // A call of the block was issued on `tensors`: its Work is kept for the end
  // where calls run one by one, its tensors where the delegate groups them.
  void keep(const c10::intrusive_ptr<c10d::Work>& work, const std::vector<at::Tensor>& tensors);
  // Closes the block: the Work of its end (ends the delegate's block, whose
  // Work is handed to `ordered` with every tensor of the block, so that later
  // calls on them are ordered after it), or null for an empty block.
  using Order = std::function<c10::intrusive_ptr<c10d::Work>(
      const std::vector<at::Tensor>& tensors,
      const std::function<c10::intrusive_ptr<c10d::Work>()>& end)>;
  c10::intrusive_ptr<c10d::Work> end(const Order& ordered);
  // Whether a block is open (its calls are the delegates', never composed).
  bool open() const;

 private:
  const c10::DeviceType acceleratorType_;
  const c10::intrusive_ptr<c10d::Backend> accelerator_;
  mutable std::mutex mu_;
  State state_{State::kClosed};
  std::vector<c10::intrusive_ptr<c10d::Work>> kept_;
  std::vector<at::Tensor> tensors_;
};

} // namespace fairring
