// The Python face of the C++ core: fairring_pg._build loads this module and
// fairring_pg.backend builds FairringBackend from the validated environment.
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include <memory>

#include "backend/fairring_backend.h"
#include "cpu/python_callback.h"
#include "cpu/ring_reaper.h"
#include "pipeline/collective_engine.h"
#include "subgroups/subgroup_allreduce.h"
#include "subgroups/call_cut.h"

namespace py = pybind11;
using fairring::BackendOptions;
using fairring::EngineOptions;
using fairring::SubgroupOptions;

namespace fairring {
namespace {
bool pythonFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// A Python callable the core keeps. Not pybind's own std::function wrapper,
// which takes the GIL to let go of the callable: a backend torch destroys only
// after the interpreter ended must leave it to the process instead.
std::shared_ptr<py::object> held(py::function f) {
  return std::shared_ptr<py::object>(new py::object(std::move(f)), [](py::object* o) {
    if (Py_IsInitialized() != 0 && !pythonFinalizing()) {
      py::gil_scoped_acquire gil;
      delete o;
    } else {
      (void)o->release();
      delete o;
    }
  });
}
} // namespace
} // namespace fairring
using fairring::FairringBackend;
using fairring::Subgroups;

namespace {

// Each path's own options, bound as the structs they are.
void bindPathOptions(py::module_& m) {
  py::class_<Subgroups>(m, "Subgroups")
      .def(py::init<>())
      .def_readwrite("world", &Subgroups::world)
      .def_readwrite("local_reduce", &Subgroups::localReduce)
      .def_readwrite("local_gather", &Subgroups::localGather)
      .def_readwrite("lanes", &Subgroups::lanes);

  // The CPU engine's options (src/pipeline/), as fairring_pg.backend fills them.
  py::class_<EngineOptions>(m, "EngineOptions")
      .def(py::init<>())
      .def_readwrite("slice_bytes", &EngineOptions::sliceBytes)
      .def_readwrite("slot_bytes", &EngineOptions::slotBytes)
      .def_readwrite("total_memory", &EngineOptions::totalMemory)
      .def_readwrite("timeout", &EngineOptions::timeout)
      .def_readwrite("start_timeout", &EngineOptions::startTimeout)
      .def_readwrite("listen_address", &EngineOptions::listenAddress)
      .def_readwrite("token", &EngineOptions::token)
      .def_readwrite("timeline_path", &EngineOptions::timelinePath)
      .def_readwrite("chunk_bytes", &EngineOptions::chunkBytes)
      .def_readwrite("rail_congestion", &EngineOptions::railCongestion);

  // The sub-group allreduce's (src/subgroups/); its rank and shape come from the layout.
  py::class_<SubgroupOptions>(m, "SubgroupOptions")
      .def(py::init<>())
      .def_readwrite("timeout", &SubgroupOptions::timeout)
      .def_readwrite("largest_piece_bytes", &SubgroupOptions::largestPieceBytes)
      .def_readwrite("lane_staging_bytes", &SubgroupOptions::laneStagingBytes)
      .def_readwrite("total_memory", &SubgroupOptions::totalMemory)
      .def(
          "set_plan",
          [](SubgroupOptions& o, const std::vector<std::tuple<size_t, std::string, int, std::string>>& rows) {
            o.plan = fairring::planRows(rows);
          },
          py::arg("rows"),
          "The plan: rows of (from_bytes, 'nccl', 'compose' or 'measure', pieces, "
          "'alltoall' or 'reduce_scatter').");
}

// What fairring_pg.backend fills in and hands over.
void bindOptions(py::module_& m) {
  bindPathOptions(m);
  py::class_<BackendOptions>(m, "Options")
      .def(py::init<>())
      .def_readwrite("machine_of", &BackendOptions::machineOf)
      .def_readwrite("local_rank_of", &BackendOptions::localRankOf)
      .def_readwrite("hostnames", &BackendOptions::hostnames)
      .def_readwrite("engine", &BackendOptions::engine)
      .def_readwrite("subgroup", &BackendOptions::subgroup)
      .def(
          "set_cpu_plan",
          [](BackendOptions& o, const std::vector<std::tuple<size_t, std::string>>& rows) {
            o.cpuPlan = fairring::cpuPlanRows(rows);
          },
          py::arg("rows"),
          "What each size of CPU allreduce runs: rows of (from_bytes, 'engine', 'ring' or 'measure').")
      .def_readwrite("ring_delegate", &BackendOptions::ringDelegate)
      .def_readwrite("accelerator_delegate_name", &BackendOptions::acceleratorDelegateName)
      .def(
          "set_on_measured",
          [](BackendOptions& o, py::function hook) {
            auto f = fairring::held(std::move(hook));
            o.onMeasured = [f](const std::string& device, const std::string& decision) {
              py::gil_scoped_acquire gil;
              try {
                (*f)(device, decision);
              } catch (py::error_already_set& e) {
                throw std::runtime_error(e.what()); // made and dropped under the GIL
              }
            };
          },
          py::arg("hook"),
          "Who is told of each decision of the measured choice: hook(device, decision as JSON).")
      .def(
          "set_own_stream",
          [](BackendOptions& o, py::function maker) {
            auto f = fairring::held(std::move(maker));
            o.ownStream = [f](c10::Device device) {
              py::gil_scoped_acquire gil;
              try {
                const auto id = (*f)(c10::DeviceTypeName(device.type(), /*lower_case=*/true), device.index())
                                    .cast<int64_t>();
                return c10::Stream(c10::Stream::UNSAFE, device, id);
              } catch (py::error_already_set& e) {
                // Its message alone: what the ranks say of a class kept.
                throw std::runtime_error(py::str(e.value()).cast<std::string>());
              } catch (const py::cast_error& e) {
                throw std::runtime_error(std::string("its maker did not return a stream id: ") + e.what());
              }
            };
          },
          py::arg("maker"),
          "Who makes the accelerator's trial timers a stream no one else is handed: "
          "maker(device type, index) -> the stream's id.")
      .def(
          "add_measured_known",
          [](BackendOptions& o, const std::string& device, size_t fromBytes, int winner,
             const std::array<double, 2>& seconds, const std::array<double, 2>& bytes) {
            TORCH_CHECK(winner == 0 || winner == 1, "fairring: a measured decision's winner is way 0 or 1");
            fairring::MeasuredDecision d;
            d.fromBytes = fromBytes;
            d.winner = winner;
            d.seconds = seconds;
            d.bytes = bytes;
            d.fromFile = true;
            o.measuredKnown.emplace_back(device, d);
          },
          py::arg("device"), py::arg("from_bytes"), py::arg("winner"), py::arg("seconds"), py::arg("bytes"),
          "A decision of the measured choice from FAIRRING_PLAN_FILE: the class of `device`'s "
          "allreduces that starts at `from_bytes` runs way `winner` (0 or 1) from its first call.")
      .def_readwrite("cuda_subgroups", &BackendOptions::cudaSubgroups)
      .def_readwrite("cuda_unavailable", &BackendOptions::cudaUnavailable)
      .def_property(
          "accelerator_type",
          [](const BackendOptions& o) { return c10::DeviceTypeName(o.acceleratorType, /*lower_case=*/true); },
          [](BackendOptions& o, const std::string& type) { o.acceleratorType = c10::Device(type).type(); })
      .def_readwrite("cpu_subgroups", &BackendOptions::cpuSubgroups);
}

void bindBackend(py::module_& m) {
  py::class_<FairringBackend, c10d::Backend, c10::intrusive_ptr<FairringBackend>>(m, "FairringBackend")
      .def(
          py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, BackendOptions options,
                      const c10::intrusive_ptr<c10d::Backend>& cpuDelegate, py::object cudaDelegate) {
            c10::intrusive_ptr<c10d::Backend> cuda;
            if (!cudaDelegate.is_none()) {
              cuda = cudaDelegate.cast<c10::intrusive_ptr<c10d::Backend>>();
            }
            // Connecting to peers blocks on the store and the network.
            py::gil_scoped_release release;
            return c10::make_intrusive<FairringBackend>(store, rank, size, std::move(options), cpuDelegate, cuda);
          }),
          py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"), py::arg("cpu_delegate"),
          py::arg("cuda_delegate") = py::none())
      .def(
          "cpu_allreduce_stats",
          [](const FairringBackend& backend) -> py::object {
            const auto stats = backend.cpuAllreduceStats();
            if (!stats) {
              return py::none();
            }
            return py::dict(
                py::arg("engine") = stats->engine, py::arg("ring") = stats->ring,
                py::arg("ring_abandoned") = stats->ringAbandoned, py::arg("ring_in_gloo") = stats->ringInGloo);
          },
          "Operations of CPU tensors run so far on fairring's engines and on Gloo's ring "
          "(FAIRRING_CPU_ALLREDUCE), ring calls given up on and ring calls Gloo runs now, "
          "or None where CPU tensors take the sub-group path.")
      .def(
          "measured_choices",
          [](const FairringBackend& backend, const std::string& device) {
            return backend.measuredDecisions(c10::Device(device).type());
          },
          py::arg("device"),
          "The measured choice's decisions for `device`'s allreduces so far, as JSON "
          "(fairring_pg.measured reads them).")
      .def(
          "subgroup_stats",
          [](const FairringBackend& backend, const std::string& device) -> py::object {
            const auto* path = backend.subgroupAllreduce(c10::Device(device).type());
            if (path == nullptr) {
              return py::none();
            }
            const fairring::SubgroupStats s = path->stats();
            return py::dict(
                py::arg("operations") = s.operations, py::arg("nccl_calls") = s.ncclCalls,
                py::arg("composed_calls") = s.composedCalls, py::arg("rows") = s.rows,
                py::arg("direct_units") = s.directUnits, py::arg("sliced_units") = s.slicedUnits,
                py::arg("ordering_waits") = s.orderingWaits,
                py::arg("unordered_in_capture") = s.unorderedInCapture, py::arg("events_created") = s.eventsCreated,
                py::arg("shutdown") = s.closed.shutdown, py::arg("aborted_groups") = s.closed.abortedGroups,
                py::arg("timeout_aborts") = s.closed.timeoutAborts);
          },
          py::arg("device"),
          "What the sub-group allreduce of `device` ('cpu': the test path, 'cuda') has done, or None "
          "where that device's plan composes nothing: operations, those given to the delegate's own "
          "allreduce, direct and sliced units, ordering waits, events made, how destroy ended.");
}

// What the process as a whole needs: the exit hook, and the marks
// fairring_pg.cpu.future_callbacks puts around Python callbacks.
void bindProcess(py::module_& m) {
  m.def(
      "shutdown_all",
      [](std::chrono::milliseconds grace) {
        fairring::ring_reaper::processExiting();
        fairring::CollectiveEngine::shutdownAll(grace);
      },
      py::arg("grace"),
      py::call_guard<py::gil_scoped_release>(),
      "Stop every fairring engine of this process (run at interpreter exit), letting posted "
      "operations finish within `grace` first.");

  // fairring_pg.cpu.future_callbacks calls these around every Python callback of a future
  // fairring handed out or one made from it, and asks these which futures those are.
  m.def("enter_future_callback", &fairring::enterPythonFutureCallback);
  m.def("exit_future_callback", &fairring::exitPythonFutureCallback);
  m.def("is_fairring_future", [](const std::shared_ptr<torch::jit::PythonFutureWrapper>& future) {
    return future && fairring::isAdoptedFuture(future->fut.get());
  });
  m.def("adopt_future", [](const std::shared_ptr<torch::jit::PythonFutureWrapper>& future) {
    if (future) {
      fairring::adoptFuture(future->fut);
    }
  });
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fairring_pg C++ core: reduction-server allreduce";
  bindOptions(m);
  bindBackend(m);
  bindProcess(m);
}
