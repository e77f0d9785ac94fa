#pragma once

#include <pybind11/pybind11.h>

// The parts of the test-only module (fairring_pg_testing), each in a file of
// its own; test_module.cpp calls them in order.
void bindStreamVehicle(pybind11::module_& m);
// The CPU engine's internals and its fault points (engine_bindings.cpp).
void bindEngine(pybind11::module_& m);
// The sub-group path's pure logic (subgroup_bindings.cpp).
void bindSubgroupLogic(pybind11::module_& m);
void bindCaptureAndDrain(pybind11::module_& m);
// The plants: test-only switches that put a known bug back (plant_bindings.cpp).
void bindPlants(pybind11::module_& m);
// The measured choice's schedule and test clock (measured_bindings.cpp).
void bindMeasured(pybind11::module_& m);
// GroupFailure on its own (failure_bindings.cpp).
void bindGroupFailure(pybind11::module_& m);
