// The stream vehicle's face in Python (tests/stream_vehicle.py).
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/extension.h>

#include <c10/core/StreamGuard.h>

#include "test_module.h"
#include "vehicle_backend.h"
#include "vehicle_device.h"
#include "vehicle_gloo.h"
#include "vehicle_ledger.h"

namespace py = pybind11;

namespace {

void bindGlooOnVehicle(py::module_& v) {
  py::class_<vehicle::GlooOnVehicle, c10d::Backend, c10::intrusive_ptr<vehicle::GlooOnVehicle>>(
      v, "GlooOnVehicle", "ProcessGroupGloo as it is with device tensors (copies through the host).")
      .def(
          py::init([](const c10::intrusive_ptr<c10d::Backend>& gloo, const std::string& name) {
            return c10::make_intrusive<vehicle::GlooOnVehicle>(gloo, name);
          }),
          py::arg("gloo"), py::arg("name"));
}

} // namespace

void bindStreamVehicle(py::module_& m) {
  auto v = m.def_submodule("vehicle", "The stream vehicle: a test-only accelerator whose streams are recorded.");
  v.def("install", [] {
    vehicle::install();
    return c10::get_privateuse1_backend();
  });
  v.def("races", [] { return vehicle::Ledger::get().races(); }, "Every unordered pair of accesses seen so far.");
  v.def("clear_races", [] { vehicle::Ledger::get().clearRaces(); });
  v.def("reset", [] { vehicle::Ledger::get().reset(); });
  v.def(
      "set_idle", [](bool idle) { vehicle::Ledger::get().setIdle(idle); }, py::arg("idle"),
      "idle: event queries say the device is done with everything issued.");
  v.def(
      "set_patience", [](int n) { vehicle::Ledger::get().setPatience(n); }, py::arg("queries"),
      "How many queries an event answers 'not yet' before 'done' (default 8).");
  v.def("synchronize", [] { vehicle::Ledger::get().hostKnowsAll(); }, "The host waits for the whole device.");
  v.def(
      "new_stream", [](const std::string& name) { return vehicle::newStream(name).id(); }, py::arg("name"));
  v.def("current_stream", [] { return vehicle::currentStream(); });
  v.def(
      "set_stream",
      [](int64_t id) {
        c10::impl::VirtualGuardImpl impl(vehicle::device().type());
        impl.exchangeStream(c10::Stream(c10::Stream::UNSAFE, vehicle::device(), id));
      },
      py::arg("id"));
  v.def(
      "wait_stream",
      [](int64_t waiter, int64_t waited) {
        c10::Event point(vehicle::device().type());
        point.record(c10::Stream(c10::Stream::UNSAFE, vehicle::device(), waited));
        point.block(c10::Stream(c10::Stream::UNSAFE, vehicle::device(), waiter));
      },
      py::arg("waiter"), py::arg("waited"), "Stream `waiter` waits for where stream `waited` stands now.");
  v.def("stream_name", [](int64_t id) { return vehicle::Ledger::get().streamName(id); });
  v.def(
      "launches",
      [] {
        py::list out;
        for (const auto& l : vehicle::Ledger::get().launches()) {
          py::list touches;
          for (const auto& t : l.touches) {
            touches.append(py::make_tuple(t.begin, t.end, t.write));
          }
          out.append(py::dict(
              py::arg("id") = l.id, py::arg("stream") = l.stream, py::arg("op") = l.op, py::arg("tick") = l.tick,
              py::arg("touches") = touches));
        }
        return out;
      },
      "Every launch so far: id, stream, op, tick and (begin, end, write) touches.");
  v.def(
      "happens_before", [](uint64_t a, uint64_t b) { return vehicle::Ledger::get().happensBefore(a, b); },
      py::arg("first"), py::arg("second"), "Whether launch `first` is ordered before launch `second`.");
  v.def(
      "record_on_stream",
      [](const at::Tensor& t, int64_t stream) {
        vehicle::recordOnStream(t, c10::Stream(c10::Stream::UNSAFE, vehicle::device(), stream));
      },
      py::arg("tensor"), py::arg("stream"));

  py::class_<vehicle::StreamedBackend, c10d::Backend, c10::intrusive_ptr<vehicle::StreamedBackend>>(
      v, "StreamedBackend", "ProcessGroupNCCL's stream behaviour over a Gloo group, for vehicle tensors.")
      .def(
          py::init([](const c10::intrusive_ptr<c10d::Backend>& gloo, const std::string& name) {
            return c10::make_intrusive<vehicle::StreamedBackend>(gloo, name);
          }),
          py::arg("gloo"), py::arg("name"))
      .def("collectives", &vehicle::StreamedBackend::collectives)
      .def("held_shelves", &vehicle::StreamedBackend::heldShelves);
  bindGlooOnVehicle(v);
  v.def(
      "is_streamed_work", [](const c10::intrusive_ptr<c10d::Work>& work) { return vehicle::isStreamedWork(work); },
      py::arg("work"), "Whether `work` is the stand-in's own Work (a collective returned as the delegate made it).");
}
