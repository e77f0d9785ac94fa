#!/usr/bin/env bash
# The CUDA tests, on a machine with one GPU: M = 2, 3 and 4 simulated machines x 1
# rank, every rank on cuda:0 with its own FAIRRING_MACHINE_ID (NCCL refuses two ranks
# on one GPU, so the intra-node group has one rank and the rail exchange runs over
# loopback). Exact results over the CPU suite's dtypes, ops and sizes; concurrent async
# allreduces from different streams; DDP of a Transformer against Gloo on CUDA; and
# the allreduce time beside Gloo-on-CUDA at 1, 25 and 100 MiB (printed, -s).
#
# Needs a CUDA build of torch (>= 2.11) already installed; it is not installed here
# because the right wheel depends on the machine's driver.
set -euo pipefail
cd "$(dirname "$0")/.."

python - <<'PY'
import sys
import torch

if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit(f"run_cuda_tests.sh: needs a GPU and a CUDA build of torch (torch {torch.__version__})")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
python -m pip install -q -e ".[test]"

# Compile the C++ core (with src/cuda/) once, up front, outside any test's deadline.
python -c "import fairring_pg._build as b; m = b.load_extension(); assert m.with_cuda, 'built without CUDA'"

python -m pytest -q -s -m cuda tests/test_cuda.py "$@"
