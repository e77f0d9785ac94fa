// The measured choice's test-only controls (src/faults/trial_clock.h) and its
// pure schedule (src/measured/trial_order.h), for tests/test_measured_choice.py.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "faults/trial_clock.h"
#include "measured/trial_order.h"
#include "test_module.h"

namespace py = pybind11;

void bindMeasured(py::module_& m) {
  auto measured = m.def_submodule("measured", "The measured choice's schedule and test clock (src/measured/).");
  measured.def(
      "trial_call",
      [](int64_t call) {
        const fairring::TrialCall t = fairring::trialCall(call);
        return py::make_tuple(t.way, t.timed);
      },
      py::arg("call"), "(way, timed) of trial call `call` of a class (0 <= call < decision_call).");
  measured.attr("decision_call") = fairring::kDecisionCall;
  measured.attr("timed_calls") = fairring::kTimedCalls;
  measured.def(
      "set_trial_seconds", &fairring::faults::setTrialSeconds, py::arg("way"), py::arg("from_bytes"),
      py::arg("seconds"),
      "Every timed trial call of `way` in the class starting at `from_bytes` (any: -1) is said to "
      "take `seconds` in this process.");
  measured.def("clear_trial_seconds", &fairring::faults::clearTrialSeconds, "Forgets every set time.");
}
