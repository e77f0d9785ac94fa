// The CPU engine's internals for tests: its slice plan laid out
// (tests/test_cuts.py) and the fault points' controls (tests/fault_points.py).
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "faults/fault_points.h"
#include "pipeline/slice_cuts.h"
#include "pipeline/wait_chain.h"
#include "test_module.h"

namespace py = pybind11;

namespace {

py::dict layOut(const fairring::SliceCuts& cuts, int localSize, int numMachines) {
  py::list slices;
  for (int64_t s = 0; s < cuts.numSlices(); ++s) {
    py::list segments;
    for (int g = 0; g < cuts.numSegments(s); ++g) {
      py::list chunks;
      for (int l = 0; l < localSize; ++l) {
        py::list shards;
        for (int m = 0; m < numMachines; ++m) {
          const fairring::Range r = cuts.shard(s, g, l, m);
          shards.append(py::make_tuple(r.begin, r.end));
        }
        const fairring::Range c = cuts.chunk(s, g, l);
        chunks.append(py::make_tuple(c.begin, c.end, shards));
      }
      const fairring::Range seg = cuts.segment(s, g);
      segments.append(py::make_tuple(seg.begin, seg.end, cuts.chunkOffset(g), cuts.shardOffset(g), chunks));
    }
    const fairring::Range sl = cuts.slice(s);
    slices.append(py::make_tuple(sl.begin, sl.end, segments));
  }
  return py::dict(
      py::arg("slices") = slices, py::arg("segment_elems") = cuts.segmentElems(),
      py::arg("max_chunk_elems") = cuts.maxChunkElems(), py::arg("max_shard_elems") = cuts.maxShardElems());
}

fairring::faults::Action actionNamed(const std::string& action) {
  if (action == "delay") {
    return fairring::faults::Action::kDelay;
  }
  if (action == "throw") {
    return fairring::faults::Action::kThrow;
  }
  TORCH_CHECK(action == "close", "faults.arm: action must be 'delay', 'throw' or 'close', got '", action, "'");
  return fairring::faults::Action::kClose;
}

} // namespace

void bindEngine(py::module_& m) {
  m.def(
      "slice_cuts",
      [](int64_t numel, int64_t sliceElems, int64_t chunkElems, int localSize, int numMachines) {
        return layOut(fairring::SliceCuts(numel, sliceElems, chunkElems, localSize, numMachines), localSize,
                      numMachines);
      },
      py::arg("numel"), py::arg("slice_elems"), py::arg("chunk_elems"), py::arg("local_size"),
      py::arg("num_machines"),
      "SliceCuts laid out: slices of (begin, end, segments); segments of (begin, end, chunk "
      "offset, shard offset, chunks); chunks of (begin, end, shards); shards of (begin, end).");

  m.def(
      "follow_wait_chain",
      [](const c10::intrusive_ptr<c10d::Store>& store, int me, uint64_t seq, std::vector<int> waited, int worldSize,
         int waitMs) {
        auto chain = std::make_shared<fairring::WaitChain>();
        {
          py::gil_scoped_release release;
          fairring::followWaitChain(
              store, me, seq, std::move(waited), worldSize,
              std::chrono::steady_clock::now() + std::chrono::milliseconds(waitMs), chain);
        }
        py::list links;
        for (const auto& link : chain->links) {
          links.append(py::make_tuple(link.rank, link.seq, link.ranks));
        }
        return py::make_tuple(links, chain->silent);
      },
      py::arg("store"), py::arg("me"), py::arg("seq"), py::arg("waited"), py::arg("world_size"), py::arg("wait_ms"),
      "The wait chain read from `store` (src/pipeline/wait_chain.h), as the engine's blame "
      "reads it: ([(rank, turn, whom it waits for)], the first rank with no note or -1).");

  auto faults = m.def_submodule("faults", "The core's fault points (src/faults/fault_points.h).");
  faults.def(
      "arm",
      [](const std::string& point, const std::string& action, int64_t delayMs, int times, int64_t key) {
        fairring::faults::arm(point, actionNamed(action), std::chrono::milliseconds(delayMs), times, key);
      },
      py::arg("point"), py::arg("action"), py::arg("delay_ms") = 0, py::arg("times") = 1, py::arg("key") = -1,
      "Arms `point` for its next `times` uses whose key matches (-1: any).");
  faults.def(
      "points",
      [] {
        std::vector<std::string> names;
        for (std::string_view name : fairring::faults::kPoints) {
          names.emplace_back(name);
        }
        return names;
      },
      "Every point the core has (arm refuses any other name).");
  faults.def("disarm", &fairring::faults::disarmAll, "Disarms every point.");
  faults.def("uses", &fairring::faults::uses, py::arg("point"), "How many times `point` fired in this process.");
  faults.def("last_use", &fairring::faults::lastUse, py::arg("point"),
             "When `point` last fired (as time.time()), 0.0 where it never did.");
}
