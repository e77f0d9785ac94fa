#include "cpu/cpu_sharded.h"

#include "ops/reduce_kind.h"

namespace fairring {

namespace {

// What the engine cannot take, as a sentence naming the tensor; empty if fine.
std::string problemWith(const at::Tensor& t, const std::string& name) {
  if (!t.defined()) {
    return name + " is undefined";
  }
  if (t.layout() != at::kStrided) {
    return name + " is not a dense (strided) tensor";
  }
  if (!t.device().is_cpu()) {
    return name + " is on device " + t.device().str() + " while the first tensor is on the CPU";
  }
  return "";
}

std::string firstProblem(const std::vector<at::Tensor>& tensors, const std::string& what) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::string p = problemWith(tensors[i], what + " " + std::to_string(i));
    if (!p.empty()) {
      return p;
    }
  }
  return "";
}

// A flat contiguous view of `t`, or a dense copy.
at::Tensor flatInput(const at::Tensor& t) {
  return t.contiguous().view({-1});
}

// A flat contiguous tensor to receive `t`'s result, and the write-back if it
// is a copy.
at::Tensor flatOutput(const at::Tensor& t, std::vector<std::function<void()>>& writeBacks) {
  if (t.is_contiguous()) {
    return t.view({-1});
  }
  at::Tensor dense = at::empty({t.numel()}, t.options().memory_format(at::MemoryFormat::Contiguous));
  writeBacks.push_back([t, dense]() mutable { t.copy_(dense.view(t.sizes())); });
  return dense;
}

std::function<void()> all(std::vector<std::function<void()>> steps) {
  if (steps.empty()) {
    return nullptr;
  }
  return [steps = std::move(steps)] {
    for (const auto& step : steps) {
      step();
    }
  };
}

std::string sameDtype(const std::vector<at::Tensor>& tensors, const std::string& what) {
  for (size_t i = 1; i < tensors.size(); ++i) {
    if (tensors[i].scalar_type() != tensors[0].scalar_type()) {
      return what + " " + std::to_string(i) + " has dtype " + dtypeName(tensors[i].scalar_type()) + " but " + what +
          " 0 has " + dtypeName(tensors[0].scalar_type());
    }
  }
  return "";
}

// The problem with a coalesced call, if any: `bigs` (reduce-scatter inputs,
// all-gather outputs) must each hold `world` x the matching one of `parts`.
std::string coalescedProblem(
    const std::vector<at::Tensor>& bigs,
    const std::string& bigName,
    const std::vector<at::Tensor>& parts,
    const std::string& partName,
    int world) {
  if (bigs.size() != parts.size() || bigs.empty()) {
    return "got " + std::to_string(bigs.size()) + " " + bigName + "s and " + std::to_string(parts.size()) + " " +
        partName + "s; expected as many of each, at least one";
  }
  std::string problem = firstProblem(bigs, bigName);
  if (problem.empty()) {
    problem = firstProblem(parts, partName);
  }
  if (problem.empty()) {
    std::vector<at::Tensor> both = bigs;
    both.insert(both.end(), parts.begin(), parts.end());
    problem = sameDtype(both, "tensor");
  }
  for (size_t t = 0; problem.empty() && t < bigs.size(); ++t) {
    if (bigs[t].numel() != parts[t].numel() * world) {
      problem = bigName + " " + std::to_string(t) + " has " + std::to_string(bigs[t].numel()) +
          " elements, expected the world size (" + std::to_string(world) + ") x " + partName + " " +
          std::to_string(t) + "'s " + std::to_string(parts[t].numel());
    }
  }
  return problem;
}

// The problem with a list call, if any: one `single` tensor per process (a
// reduce-scatter's output, an all-gather's input) and one list of `world`
// tensors (its inputs, its outputs) that each match it.
std::string listProblem(
    const std::vector<at::Tensor>& singles,
    const std::string& singleName,
    const std::vector<std::vector<at::Tensor>>& lists,
    const std::string& listName,
    int world,
    const std::string& hint) {
  if (singles.size() != 1 || lists.size() != 1) {
    return "takes one " + singleName + " and one list of " + listName + "s per process, got " +
        std::to_string(singles.size()) + " and " + std::to_string(lists.size());
  }
  const at::Tensor& single = singles[0];
  const std::vector<at::Tensor>& list = lists[0];
  if (list.size() != static_cast<size_t>(world)) {
    return "the " + listName + " list has " + std::to_string(list.size()) + " tensors, expected the world size " +
        std::to_string(world);
  }
  std::string problem = problemWith(single, "the " + singleName);
  if (problem.empty()) {
    problem = firstProblem(list, listName);
  }
  for (size_t r = 0; problem.empty() && r < list.size(); ++r) {
    if (list[r].numel() != single.numel() || list[r].scalar_type() != single.scalar_type()) {
      problem = listName + " " + std::to_string(r) + " has " + std::to_string(list[r].numel()) + " elements of " +
          dtypeName(list[r].scalar_type()) + ", the " + singleName + " " + std::to_string(single.numel()) + " of " +
          dtypeName(single.scalar_type()) + "; every " + listName + " must match the " + singleName + hint;
    }
  }
  return problem;
}

} // namespace

c10::intrusive_ptr<c10d::Work> CpuSharded::issue(
    Call call,
    c10d::OpType opType,
    const char* profilingTitle,
    const std::vector<at::Tensor>& inputs) {
  return runner_.runOn(
      [&](CollectiveEngine& engine) {
        if (!call.problem.empty()) {
          engine.refuse(
              std::string("fairring: ") + opKindName(call.kind) + " on " +
              engine.layout().describe(engine.layout().rank()) + ": " + call.problem);
        }
        return engine.enqueueSharded(
            call.kind, call.input, call.output, call.op, std::move(call.results), std::move(call.finish));
      },
      opType, profilingTitle, inputs);
}

CpuSharded::Call CpuSharded::tensorCall(OpKind kind, at::Tensor& output, at::Tensor& input) {
  Call call(kind);
  call.problem = problemWith(input, "the input");
  if (call.problem.empty()) {
    call.problem = problemWith(output, "the output");
  }
  std::vector<std::function<void()>> writeBacks;
  if (call.problem.empty()) {
    call.input = flatInput(input);
    call.output = flatOutput(output, writeBacks);
  }
  call.results = {output};
  call.finish = all(std::move(writeBacks));
  return call;
}

c10::intrusive_ptr<c10d::Work> CpuSharded::reduceScatterBase(
    at::Tensor& output,
    at::Tensor& input,
    c10d::ReduceOp::RedOpType op) {
  Call call = tensorCall(OpKind::kReduceScatter, output, input);
  call.op = op;
  return issue(std::move(call), c10d::OpType::_REDUCE_SCATTER_BASE, "fairring:_reduce_scatter_base", {input});
}

c10::intrusive_ptr<c10d::Work> CpuSharded::reduceScatterList(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    c10d::ReduceOp::RedOpType op) {
  Call call(OpKind::kReduceScatter);
  call.op = op;
  call.problem = listProblem(outputs, "output", inputs, "input", worldSize_, "");
  std::vector<std::function<void()>> writeBacks;
  if (call.problem.empty()) {
    std::vector<at::Tensor> flat;
    for (const at::Tensor& t : inputs[0]) {
      flat.push_back(t.reshape({-1}));
    }
    call.input = at::cat(flat);
    call.output = flatOutput(outputs[0], writeBacks);
  }
  call.results = outputs;
  call.finish = all(std::move(writeBacks));
  std::vector<at::Tensor> profiled = inputs.empty() ? std::vector<at::Tensor>{} : inputs[0];
  return issue(std::move(call), c10d::OpType::REDUCE_SCATTER, "fairring:reduce_scatter", profiled);
}

c10::intrusive_ptr<c10d::Work> CpuSharded::reduceScatterCoalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    c10d::ReduceOp::RedOpType op) {
  Call call(OpKind::kReduceScatter);
  call.op = op;
  call.problem = coalescedProblem(inputs, "input", outputs, "output", worldSize_);
  if (call.problem.empty()) {
    // Rank r's part of the packed input is rank r's part of every input, in order.
    std::vector<at::Tensor> byRank;
    int64_t total = 0;
    for (size_t t = 0; t < inputs.size(); ++t) {
      byRank.push_back(inputs[t].reshape({worldSize_, outputs[t].numel()}));
      total += outputs[t].numel();
    }
    call.input = at::cat(byRank, 1).reshape({-1});
    call.output = at::empty({total}, outputs[0].options().memory_format(at::MemoryFormat::Contiguous));
    call.finish = [packed = call.output, outputs]() mutable {
      int64_t offset = 0;
      for (at::Tensor& t : outputs) {
        t.copy_(packed.slice(0, offset, offset + t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    };
  }
  call.results = outputs;
  // OpType::REDUCE_SCATTER_TENSOR_COALESCED is newer than torch 2.11, which the core
  // must also build against.
  return issue(std::move(call), c10d::OpType::COALESCED, "fairring:reduce_scatter_tensor_coalesced", inputs);
}

c10::intrusive_ptr<c10d::Work> CpuSharded::allGatherBase(at::Tensor& output, at::Tensor& input) {
  return issue(
      tensorCall(OpKind::kAllGather, output, input), c10d::OpType::_ALLGATHER_BASE, "fairring:_allgather_base", {input});
}

c10::intrusive_ptr<c10d::Work> CpuSharded::allGatherList(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs) {
  Call call(OpKind::kAllGather);
  call.problem = listProblem(
      inputs, "input", outputs, "output", worldSize_, " (sizes that differ between ranks go to all_gather_object)");
  if (call.problem.empty()) {
    const int64_t n = inputs[0].numel();
    call.input = flatInput(inputs[0]);
    call.output = at::empty({n * worldSize_}, inputs[0].options().memory_format(at::MemoryFormat::Contiguous));
    call.finish = [packed = call.output, list = outputs[0], n]() mutable {
      for (size_t r = 0; r < list.size(); ++r) {
        list[r].copy_(packed.slice(0, r * n, (r + 1) * n).view(list[r].sizes()));
      }
    };
  }
  call.results = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
  return issue(std::move(call), c10d::OpType::ALLGATHER, "fairring:all_gather", inputs);
}

c10::intrusive_ptr<c10d::Work> CpuSharded::allGatherCoalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs) {
  Call call(OpKind::kAllGather);
  call.problem = coalescedProblem(outputs, "output", inputs, "input", worldSize_);
  if (call.problem.empty()) {
    std::vector<at::Tensor> flat;
    int64_t total = 0;
    for (const at::Tensor& t : inputs) {
      flat.push_back(t.reshape({-1}));
      total += t.numel();
    }
    call.input = at::cat(flat);
    call.output = at::empty({total * worldSize_}, inputs[0].options().memory_format(at::MemoryFormat::Contiguous));
    // Rank r's part of the packed output is rank r's part of every output.
    call.finish = [packed = call.output, outputs, inputs, total, world = worldSize_]() mutable {
      int64_t offset = 0;
      for (size_t t = 0; t < outputs.size(); ++t) {
        const int64_t n = inputs[t].numel();
        at::Tensor parts = packed.view({world, total}).slice(1, offset, offset + n);
        outputs[t].copy_(parts.reshape(outputs[t].sizes()));
        offset += n;
      }
    };
  }
  call.results = outputs;
  return issue(std::move(call), c10d::OpType::ALLGATHER_COALESCED, "fairring:all_gather_into_tensor_coalesced", inputs);
}

} // namespace fairring
