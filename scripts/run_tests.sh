#!/usr/bin/env bash
# The README's test command: install what the tests need on a fresh machine, then run
# the whole suite (multi-process CPU tests on simulated machines; CUDA tests skip
# without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# A torch already installed (CPU or CUDA build) is kept. Without one, this installs
# torch 2.13.0 from pip's configured index: from PyPI on Linux that is the default
# CUDA build (several GB of CUDA wheels). For the small CPU-only build, install torch
# from PyTorch's CPU index first (README, "Install").
if ! python -c "import torch" >/dev/null 2>&1; then
    python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[test]"

# Compile the C++ core once, up front, so that no test's deadline pays for it.
python -c "import fairring_pg._build as b; b.load_extension()"

python -m pytest -q tests "$@"
