// GroupFailure (src/failure/group_failure.h) on its own, for the table tests of
// its rules (tests/test_group_failure.py): no engine, no connections, and time
// given as milliseconds on its steady clock, so that the grace is tested
// without waiting for it.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <chrono>
#include <optional>
#include <string>

#include "failure/group_failure.h"
#include "test_module.h"

namespace py = pybind11;

namespace {

using fairring::GroupFailure;

GroupFailure::Clock::time_point atMs(int64_t ms) {
  return GroupFailure::Clock::time_point(std::chrono::milliseconds(ms));
}

int64_t msOf(GroupFailure::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}

std::optional<py::tuple> asTuple(const std::optional<GroupFailure::Abort>& abort) {
  if (!abort) {
    return std::nullopt;
  }
  return py::make_tuple(abort->reason, abort->fromSeq);
}

} // namespace

void bindGroupFailure(py::module_& m) {
  py::class_<GroupFailure>(m, "GroupFailure", "src/failure/group_failure.h, one group's failure on its own.")
      .def(py::init<>())
      .def_property_readonly_static("NONE", [](const py::object&) { return GroupFailure::kNone; })
      .def_property_readonly_static(
          "ABORT_GRACE_MS", [](const py::object&) { return GroupFailure::kAbortGrace.count(); })
      .def(
          "fail", &GroupFailure::fail, py::arg("message"), py::arg("from_seq"),
          "The turn failed before (NONE if healthy), or None if nothing newly failed.")
      .def("failed", &GroupFailure::failed)
      .def("fails", &GroupFailure::fails, py::arg("seq"))
      .def("fail_seq", &GroupFailure::failSeq)
      .def("reason", &GroupFailure::reason)
      .def("refusal", &GroupFailure::refusal)
      .def("peer_lost", &GroupFailure::peerLost, py::arg("message"), py::arg("needed"))
      .def("departed", &GroupFailure::departed)
      .def(
          "abort_due", [](GroupFailure& f, bool stopping) { return asTuple(f.abortDue(stopping)); },
          py::arg("stopping"), "(reason, from_seq) to send now, or None.")
      .def("connected", [](GroupFailure& f) { return asTuple(f.connected()); }, "The abort held meanwhile, or None.")
      .def(
          "aborts_queued",
          [](GroupFailure& f, const std::vector<int>& peers, int64_t ms) { return f.abortsQueued(peers, atMs(ms)); },
          py::arg("peers"), py::arg("at_ms"), "The round, for abort_left.")
      .def("abort_left", &GroupFailure::abortLeft, py::arg("peer"), py::arg("round"))
      .def(
          "may_close", [](const GroupFailure& f, int64_t ms) { return f.mayClose(atMs(ms)); }, py::arg("at_ms"))
      .def(
          "aborts_deadline", [](const GroupFailure& f, int64_t ms) { return msOf(f.abortsDeadline(atMs(ms))); },
          py::arg("at_ms"))
      .def_static("forwarded", &GroupFailure::forwarded, py::arg("reason"), py::arg("me"), py::arg("peer"));
}
