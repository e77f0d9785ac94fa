#include "pipeline/turn_ledger.h"

namespace fairring {

Operation* TurnLedger::find(uint64_t seq, const Locked&) const {
  auto it = ops_.find(seq);
  return it == ops_.end() ? nullptr : it->second.get();
}

Operation& TurnLedger::add(std::unique_ptr<Operation> op, bool inOrder, const Locked&) {
  if (inOrder) {
    for (const Slice& slice : op->slices) {
      waitingForPlace_.emplace_back(op->seq, slice.index);
    }
  }
  Operation& added = *op;
  ops_[op->seq] = std::move(op);
  return added;
}

std::shared_ptr<Operation> TurnLedger::retire(uint64_t seq, const Locked&) {
  auto it = ops_.find(seq);
  std::shared_ptr<Operation> finished(std::move(it->second));
  ops_.erase(it);
  return finished;
}

std::vector<Operation*> TurnLedger::bury(uint64_t fromSeq, const Locked&) {
  std::vector<Operation*> failed;
  for (auto it = ops_.lower_bound(fromSeq); it != ops_.end();) {
    failed.push_back(it->second.get());
    buried_.push_back(std::move(it->second));
    it = ops_.erase(it);
  }
  return failed;
}

std::optional<TurnLedger::Ready> TurnLedger::nextReady(
    const std::function<bool(const Operation&)>& stages,
    const Locked&) {
  while (!waitingForPlace_.empty()) {
    auto [seq, s] = waitingForPlace_.front();
    auto it = ops_.find(seq);
    if (it == ops_.end()) { // failed meanwhile
      waitingForPlace_.pop_front();
      continue;
    }
    Operation& op = *it->second;
    Slice& slice = op.slices[s];
    const bool staged = stages(op);
    if (staged) {
      const int slot = staging_.tryAcquire();
      if (slot < 0) {
        return std::nullopt;
      }
      slice.slot = slot;
      slice.staging = staging_.data(slot);
    }
    waitingForPlace_.pop_front();
    return Ready{&op, &slice, staged};
  }
  return std::nullopt;
}

void TurnLedger::releaseSlot(Slice& slice, const Locked&) {
  staging_.release(slice.slot);
  slice.slot = -1;
  slice.staging = nullptr;
}

} // namespace fairring
