// The Python face of the C++ core: fairring_pg._build loads this module and
// fairring_pg.backend builds FairringBackend from the validated environment.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/extension.h>

#include "backend/fairring_backend.h"
#include "backend/python_callback.h"
#include "pipeline/allreduce_engine.h"
#include "staging/staging_pool.h"
#include "subgroups/subgroup_allreduce.h"
#include "subgroups/unit_plan.h"

namespace py = pybind11;
using fairring::BackendOptions;
using fairring::FairringBackend;
using fairring::Subgroups;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fairring_pg C++ core: reduction-server allreduce";

  py::class_<Subgroups>(m, "Subgroups")
      .def(py::init<>())
      .def_readwrite("world", &Subgroups::world)
      .def_readwrite("local_reduce", &Subgroups::localReduce)
      .def_readwrite("local_gather", &Subgroups::localGather)
      .def_readwrite("lanes", &Subgroups::lanes);

  py::class_<BackendOptions>(m, "Options")
      .def(py::init<>())
      .def_readwrite("slice_size", &BackendOptions::sliceSize)
      .def_readwrite("total_memory", &BackendOptions::totalMemory)
      .def_readwrite("machine_of", &BackendOptions::machineOf)
      .def_readwrite("hostnames", &BackendOptions::hostnames)
      .def_readwrite("listen_address", &BackendOptions::listenAddress)
      .def_readwrite("job_token", &BackendOptions::jobToken)
      .def_readwrite("timeout", &BackendOptions::timeout)
      .def_readwrite("timeline_path", &BackendOptions::timelinePath)
      .def_readwrite("pipeline_chunk", &BackendOptions::pipelineChunk)
      .def_readwrite("subgroup_slice_size", &BackendOptions::subgroupSliceBytes)
      .def_readwrite("direct_below", &BackendOptions::directBelowBytes)
      .def_readwrite("cuda_subgroups", &BackendOptions::cudaSubgroups)
      .def_readwrite("cpu_subgroups", &BackendOptions::cpuSubgroups);

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
          py::arg("cuda_delegate") = py::none());

  m.def(
      "shutdown_all", &fairring::AllreduceEngine::shutdownAll, py::arg("grace"),
      py::call_guard<py::gil_scoped_release>(),
      "Stop every fairring engine of this process (run at interpreter exit), letting posted "
      "operations finish within `grace` first.");

  // fairring_pg.future_callbacks calls these around every Python callback of a torch Future.
  m.def("enter_future_callback", &fairring::enterPythonFutureCallback);
  m.def("exit_future_callback", &fairring::exitPythonFutureCallback);

  // Same argument order as fairring_pg.config.staging_slot_bytes, which a test compares it with.
  m.def(
      "staging_slot_bytes",
      [](size_t sliceSize, int numMachines, int localSize) {
        return fairring::stagingSlotBytes(sliceSize, localSize, numMachines);
      },
      py::arg("slice_size"), py::arg("num_machines"), py::arg("local_size"),
      "Bytes of one staging slot (must equal fairring_pg.config's formula).");

  m.def(
      "lane_staging_bytes",
      [](size_t sliceSize, int numMachines, int localSize) {
        return fairring::laneStagingBytes(sliceSize, localSize, numMachines);
      },
      py::arg("slice_size"), py::arg("num_machines"), py::arg("local_size"),
      "Bytes of one lane's staging in the sub-group path (must equal fairring_pg.config's formula).");
}
