// The plants' controls (src/faults/plants.h) for tests/stream_mutants.py and the
// tests it runs.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "faults/plants.h"
#include "test_module.h"

namespace py = pybind11;

void bindPlants(py::module_& m) {
  auto plants = m.def_submodule("plants", "Test-only switches that put a known bug back (src/faults/plants.h).");
  plants.def("names", &fairring::plants::names, "Every plant's name.");
  plants.def(
      "arm", &fairring::plants::arm, py::arg("name"),
      "Puts the bug called `name` back in this process; an unknown name is refused.");
  plants.def("disarm", &fairring::plants::disarmAll, "Takes every plant out.");
}
