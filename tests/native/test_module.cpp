// fairring_pg_testing: native code the test suite needs and a user never
// loads (fairring_pg._build.load_test_extension), linked against the core.
#include <torch/extension.h>

#include "test_module.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fairring_pg's test-only native module";
  bindStreamVehicle(m);
  bindEngine(m);
  bindSubgroupLogic(m);
  bindCaptureAndDrain(m);
  bindPlants(m);
  bindMeasured(m);
  bindGroupFailure(m);
}
