#pragma once

#include <pybind11/pybind11.h>

// The parts of the test-only module (fairring_pg_testing), each in a file of
// its own; test_module.cpp calls them in order.
void bindStreamVehicle(pybind11::module_& m);
