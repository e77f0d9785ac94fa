#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

#include "cpu/cpu_allreduce.h"

namespace fairring {

// Reduce-scatter and all-gather of CPU tensors on fairring's engine, in every
// form torch hands them to a backend. Each form becomes one engine operation
// on a flat contiguous input and output: list and coalesced forms are packed
// into one (a copy) and unpacked when it is done, non-contiguous tensors go
// through dense copies. A malformed call is refused on every rank
// (CollectiveEngine::refuse): the peers would otherwise wait for it.
// Futures and callbacks behave as the allreduce's (CpuAllreduce).
class CpuSharded {
 public:
  CpuSharded(CpuAllreduce& runner, int worldSize) : runner_(runner), worldSize_(worldSize) {}

  c10::intrusive_ptr<c10d::Work> reduceScatterBase(at::Tensor& output, at::Tensor& input, c10d::ReduceOp::RedOpType op);
  c10::intrusive_ptr<c10d::Work> reduceScatterList(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      c10d::ReduceOp::RedOpType op);
  c10::intrusive_ptr<c10d::Work> reduceScatterCoalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      c10d::ReduceOp::RedOpType op);

  c10::intrusive_ptr<c10d::Work> allGatherBase(at::Tensor& output, at::Tensor& input);
  c10::intrusive_ptr<c10d::Work> allGatherList(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs);
  c10::intrusive_ptr<c10d::Work> allGatherCoalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs);

 private:
  // One engine operation. `problem`, if not empty, is refused on every rank.
  struct Call {
    explicit Call(OpKind k) : kind(k) {}
    OpKind kind;
    std::string problem;
    at::Tensor input; // flat, contiguous
    at::Tensor output; // flat, contiguous
    c10d::ReduceOp::RedOpType op{c10d::ReduceOp::SUM};
    std::vector<at::Tensor> results; // the future's value
    std::function<void()> finish; // unpacks into the caller's tensors
  };
  // The tensor forms: one input, one output, each possibly a dense copy.
  static Call tensorCall(OpKind kind, at::Tensor& output, at::Tensor& input);
  c10::intrusive_ptr<c10d::Work> issue(
      Call call,
      c10d::OpType opType,
      const char* profilingTitle,
      const std::vector<at::Tensor>& inputs);

  CpuAllreduce& runner_;
  const int worldSize_;
};

} // namespace fairring
