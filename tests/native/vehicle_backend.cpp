#include "vehicle_backend.h"

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cctype>
#include <numeric>
#include <cstdlib>
#include <string>

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

// torch's getCvarBool (torch/csrc/distributed/c10d/Utils.hpp) over
// TORCH_NCCL_BLOCKING_WAIT's names (ProcessGroupNCCL.hpp): read from the last
// name to the first, so the first one set decides; its spellings, in any case.
bool blockingWaitFromEnv() {
  bool on = false;
  for (const char* name : {"NCCL_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT"}) {
    const char* raw = std::getenv(name);
    if (raw == nullptr) {
      continue;
    }
    std::string value(raw);
    for (char& c : value) {
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    if (value == "y" || value == "yes" || value == "1" || value == "t" || value == "true") {
      on = true;
    } else if (value == "n" || value == "no" || value == "0" || value == "f" || value == "false") {
      on = false;
    } else {
      TORCH_CHECK(false, "Invalid value ", value, " for environment variable ", name);
    }
  }
  return on;
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
    if (c10d::allow_inflight_collective_as_graph_input()) {
      c10d::unregister_work(c10::intrusive_ptr<c10d::Work>::unsafe_reclaim_from_nonowning(this));
    }
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
    // Into a new list: moving an entry onto itself would empty its clock (a
    // vector moved onto itself is left empty), and an empty clock reads as
    // ended at the next call, freeing a shelf whose collective may still run.
    std::vector<Watched> still;
    for (auto& w : watched_) {
      if (Ledger::get().hostKnowsDone(w.end)) {
        ended.push_back(std::move(w.shelf));
      } else {
        still.push_back(std::move(w));
      }
    }
    watched_.swap(still);
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
    const std::function<void()>& onHost,
    bool eventless) {
  checkAll(inputs, op);
  checkAll(outputs, op);
  releaseEnded();
  ++collectives_;
  std::vector<at::Tensor> writes(outputs);
  writes.insert(writes.end(), temporaries.begin(), temporaries.end());
  if (!async && !coalescing_) {
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
    future->markCompleted(eventless ? c10::IValue(std::vector<at::Tensor>{}) : c10::IValue(outputs));
  }
  if (coalescing_) {
    // A collective inside a block runs now, on the group's stream, where the
    // block's end is ordered after it; it returns no Work, as ProcessGroupNCCL's.
    return c10::intrusive_ptr<c10d::Work>();
  }
  return c10::make_intrusive<StreamedWork>(
      std::move(end), std::move(endClock), outputs, future, std::move(shelf), blockingWait_);
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return run("allreduce", opts.asyncOp, tensors, tensors, {}, [&] {
    auto views = hostViews(tensors);
    // NCCL averages; Gloo does not: 16-bit floats divided by N first, as
    // NCCL's AVG premultiplies, and summed; other floats summed and divided.
    const bool average = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
    const bool premultiplied = average && !views.empty() &&
        (views[0].scalar_type() == at::kHalf || views[0].scalar_type() == at::kBFloat16);
    c10d::AllreduceOptions summed = opts;
    if (average) {
      summed.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    }
    if (premultiplied) {
      for (at::Tensor& view : views) {
        view.div_(getSize());
      }
    }
    gloo_->allreduce(views, summed)->wait();
    if (average && !premultiplied) {
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
  bool even = true;
  for (const at::Tensor& t : outputs[0]) {
    even = even && t.sizes() == inputs.at(0).sizes();
  }
  if (!even) {
    // ProcessGroupNCCL: a broadcast from each rank in a coalescing block, one
    // Work whose future is marked with an empty list.
    return run(
        "allgather (uneven: broadcasts, coalesced)", opts.asyncOp, inputs, outputs[0], {},
        [&] {
          for (int root = 0; root < getSize(); ++root) {
            at::Tensor out = hostView(outputs[0][root]);
            if (root == getRank()) {
              out.copy_(hostView(inputs[0]));
            }
            std::vector<at::Tensor> one{out};
            c10d::BroadcastOptions b;
            b.rootRank = root;
            gloo_->broadcast(one, b)->wait();
          }
        },
        /*eventless=*/true);
  }
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
  bool even = true;
  for (const at::Tensor& t : inputs[0]) {
    even = even && t.sizes() == outputs[0].sizes();
  }
  if (!even) {
    // ProcessGroupNCCL: a reduce to each rank in a coalescing block (here of a
    // host copy, Gloo's reduce writing in place), one Work whose future is
    // marked with an empty list.
    return run(
        "reduce_scatter (uneven: reduces, coalesced)", opts.asyncOp, inputs[0], outputs, {},
        [&] {
          for (int root = 0; root < getSize(); ++root) {
            std::vector<at::Tensor> one{hostView(inputs[0][root]).clone()};
            c10d::ReduceOptions r;
            r.rootRank = root;
            r.reduceOp = opts.reduceOp;
            gloo_->reduce(one, r)->wait();
            if (root == getRank()) {
              hostView(outputs[0]).copy_(one[0].view(outputs[0].sizes()));
            }
          }
        },
        /*eventless=*/true);
  }
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

c10::intrusive_ptr<c10d::Work> StreamedBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  // NCCL's list form is one collective; over Gloo, one all-to-all of flat
  // copies with the lists' sizes as splits.
  return run("all-to-all (list)", opts.asyncOp, inputs, outputs, {}, [&] {
    std::vector<int64_t> inSplits;
    std::vector<int64_t> outSplits;
    std::vector<at::Tensor> ins;
    std::vector<at::Tensor> outs;
    for (const at::Tensor& t : inputs) {
      ins.push_back(hostView(t).reshape({-1}));
      inSplits.push_back(t.numel());
    }
    for (const at::Tensor& t : outputs) {
      outSplits.push_back(t.numel());
    }
    at::Tensor in = at::cat(ins);
    at::Tensor out = at::empty({std::accumulate(outSplits.begin(), outSplits.end(), int64_t{0})}, in.options());
    // Copies: Gloo's alltoall_base takes the splits by reference and moves them away.
    std::vector<int64_t> outCounts(outSplits);
    std::vector<int64_t> inCounts(inSplits);
    gloo_->alltoall_base(out, in, outCounts, inCounts, opts)->wait();
    int64_t offset = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      hostView(outputs[i]).copy_(out.narrow(0, offset, outSplits[i]).view(outputs[i].sizes()));
      offset += outSplits[i];
    }
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::pointToPoint(
    const std::string& op,
    int peer,
    const std::vector<at::Tensor>& tensors,
    bool writes,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
  checkAll(tensors, op);
  releaseEnded();
  const std::vector<at::Tensor> none;
  if (coalescing_) {
    // Inside a block: on the group's communicator at the block's end.
    deferred_.push_back(Deferred{op, writes ? none : tensors, writes ? tensors : none, start});
    return c10::intrusive_ptr<c10d::Work>();
  }
  Pair* pair = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pairs_.find(peer);
    if (it == pairs_.end()) {
      const int low = std::min(getRank(), peer);
      const int high = std::max(getRank(), peer);
      const std::string key = name_ + " pair " + std::to_string(low) + ":" + std::to_string(high);
      it = pairs_.emplace(peer, Pair{newStream(key).id(), std::make_shared<c10::Event>(device().type())}).first;
    }
    pair = &it->second;
  }
  // Always asynchronous, on the pair's stream, which waits for the caller's
  // (ProcessGroupNCCL::pointToPoint returns a Work for a synchronous call too).
  const c10::Stream stream(c10::Stream::UNSAFE, device(), pair->stream);
  c10::Event issued(device().type());
  issued.record(current());
  issued.block(stream);
  pair->previous->block(stream);
  {
    c10::StreamGuard onStream(stream);
    recordLaunch(name_ + ": " + op, writes ? none : tensors, writes ? tensors : none);
    start()->wait();
  }
  pair->previous->record(stream);
  c10::Event end(device().type());
  end.record(stream);
  Clock endClock = Ledger::get().clockOf(pair->stream);
  // pointToPoint tells the allocator (recordStream) rather than a shelf.
  for (const at::Tensor& t : tensors) {
    recordOnStream(t, stream);
  }
  auto shelf = std::make_shared<Shelf>();
  auto future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device()});
  {
    c10::StreamGuard onStream(stream);
    future->markCompleted(c10::IValue(tensors));
  }
  return c10::make_intrusive<StreamedWork>(
      std::move(end), std::move(endClock), tensors, future, std::move(shelf), blockingWait_);
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  std::vector<at::Tensor> views = hostViews(tensors);
  return pointToPoint("send to " + std::to_string(dstRank), dstRank, tensors, /*writes=*/false, [this, views, dstRank, tag]() mutable {
    return gloo_->send(views, dstRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  std::vector<at::Tensor> views = hostViews(tensors);
  return pointToPoint("recv from " + std::to_string(srcRank), srcRank, tensors, /*writes=*/true, [this, views, srcRank, tag]() mutable {
    return gloo_->recv(views, srcRank, tag);
  });
}

void StreamedBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "vehicle: startCoalescing inside a coalescing block");
  coalescing_ = true;
}

c10::intrusive_ptr<c10d::Work> StreamedBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "vehicle: endCoalescing without startCoalescing");
  coalescing_ = false;
  std::vector<Deferred> calls;
  calls.swap(deferred_);
  if (calls.empty()) {
    return c10::intrusive_ptr<c10d::Work>(); // as ProcessGroupNCCL's, for an empty block
  }
  std::vector<at::Tensor> reads;
  std::vector<at::Tensor> writes;
  for (const Deferred& d : calls) {
    reads.insert(reads.end(), d.reads.begin(), d.reads.end());
    writes.insert(writes.end(), d.writes.begin(), d.writes.end());
  }
  // One launch, after the block's collectives on the group's stream: the
  // sends and receives issued together (NCCL's group), then waited for.
  return run(
      "coalesced block of " + std::to_string(calls.size()), true, reads, writes, {},
      [&] {
        std::vector<c10::intrusive_ptr<c10d::Work>> started;
        for (const Deferred& d : calls) {
          started.push_back(d.start());
        }
        for (const auto& w : started) {
          w->wait();
        }
      },
      /*eventless=*/true);
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
