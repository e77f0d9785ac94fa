// The sub-group path's logic laid out for tests that need no GPU
// (tests/test_subgroup_logic.py, tests/test_cuts.py): its call cut, byte
// ranges and in-flight ordering, the capture states and the drain.
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "subgroups/blocking_wait.h"
#include "subgroups/call_cut.h"
#include "subgroups/capture_probe.h"
#include "subgroups/drain.h"
#include "subgroups/in_flight_ops.h"
#include "test_module.h"

namespace py = pybind11;

void bindSubgroupLogic(py::module_& m) {
  m.def(
      "read_blocking_wait",
      [](const std::map<std::string, std::string>& env) {
        const fairring::BlockingWait read = fairring::readBlockingWait([&](const char* name) -> const char* {
          auto it = env.find(name);
          return it == env.end() ? nullptr : it->second.c_str();
        });
        return std::make_tuple(read.on, read.status.message());
      },
      py::arg("env"), "(on, error) of TORCH_NCCL_BLOCKING_WAIT and NCCL_BLOCKING_WAIT as `env` sets them.");

  m.def(
      "cut_call",
      [](int64_t numel, size_t elemSize, const std::vector<std::tuple<size_t, std::string, int, std::string>>& rows,
         size_t largestPiece, int localSize, int numMachines) {
        const fairring::CallCut cut =
            fairring::cutCall(numel, elemSize, fairring::planRows(rows), largestPiece, localSize, numMachines);
        py::list units;
        for (const auto& u : cut.units) {
          units.append(py::make_tuple(u.begin, u.size, u.direct));
        }
        return py::make_tuple(cut.row, units);
      },
      py::arg("numel"), py::arg("elem_size"), py::arg("rows"), py::arg("largest_piece"), py::arg("local_size"),
      py::arg("num_machines"), "cutCall: (the row taken, units as (begin, size, direct)).");

  // The sub-group path's pure logic, for tests that need no GPU (tests/test_subgroup_logic.py).
  m.def(
      "byte_ranges",
      [](const std::vector<at::Tensor>& tensors) {
        py::list ranges;
        for (const auto& r : fairring::byteRangesOf(tensors)) {
          ranges.append(py::make_tuple(r.begin, r.end));
        }
        return ranges;
      },
      py::arg("tensors"), "The byte ranges the same-memory ordering sees for `tensors`: (begin, end) each.");

  using ProbeOps = fairring::InFlightOps<int64_t>;
  py::class_<ProbeOps>(m, "InFlightOpsProbe", "InFlightOps with integer ids for events.")
      .def(py::init<>())
      .def(
          "add", [](ProbeOps& ops, const std::vector<at::Tensor>& tensors, int64_t id) {
            ops.add(fairring::byteRangesOf(tensors), id);
          })
      .def(
          "overlapping",
          [](const ProbeOps& ops, const std::vector<at::Tensor>& tensors) {
            return ops.overlapping(fairring::byteRangesOf(tensors));
          })
      .def(
          "forget",
          [](ProbeOps& ops, const std::function<bool(int64_t)>& reached) {
            ops.forget([&](int64_t id) { return reached(id); });
          })
      .def("all", &ProbeOps::all)
      .def("__len__", &ProbeOps::size);
}

void bindCaptureAndDrain(py::module_& m) {
  m.def(
      "capture_state",
      [](int result, int status) { return fairring::captureStateName(fairring::captureStateFrom(result, status)); },
      py::arg("result"), py::arg("status"),
      "What cuStreamIsCapturing's (CUresult, status) mean to fairring: none, active, invalidated, implicit, unknown.");
  m.def("is_capturing", [](const std::string& state) {
    for (auto s : {fairring::CaptureState::kNone, fairring::CaptureState::kActive, fairring::CaptureState::kInvalidated,
                   fairring::CaptureState::kImplicit, fairring::CaptureState::kUnknown}) {
      if (state == fairring::captureStateName(s)) {
        return fairring::isCapturing(s);
      }
    }
    TORCH_CHECK(false, "is_capturing: unknown state '", state, "'");
  });
  py::class_<fairring::CaptureProbe, std::shared_ptr<fairring::CaptureProbe>>(
      m, "CaptureProbe", "cuStreamIsCapturing looked up in a named library.")
      .def(py::init<const std::string&>(), py::arg("library"))
      .def(
          "state",
          [](fairring::CaptureProbe& probe, uintptr_t stream) {
            torch::PyWarningHandler warnings; // its warning reaches Python's warnings
            return fairring::captureStateName(probe.state(reinterpret_cast<void*>(stream)));
          },
          py::arg("stream"));

  m.def(
      "drain_until",
      [](const std::vector<std::function<bool()>>& pending, const std::function<bool()>& failed,
         std::chrono::milliseconds timeout) {
        return fairring::drainEndName(
            fairring::drainUntil(pending, failed, std::chrono::steady_clock::now() + timeout));
      },
      py::arg("pending"), py::arg("failed"), py::arg("timeout"),
      "drainUntil with Python predicates: 'drained', 'failed' or 'timed out'.");
}
