#!/usr/bin/env bash
# The README's test command: install what the tests need, run the whole suite on the
# torch that is installed (multi-process CPU tests on simulated machines; CUDA tests
# skip without a GPU), then scripts/compat_check.sh: the core built against the oldest
# torch we declare, in a venv of its own, and a short smoke test on it (COMPAT_TORCH=none
# skips that; COMPAT_TORCH=2.13.0 checks another release).
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# An installed torch (CPU or CUDA build) is kept. Without one, pip brings the newest
# release it resolves torch>=2.11 to, as a user's `pip install .` does: from PyPI on
# Linux the CUDA build (several GB of CUDA wheels). For the small CPU-only build,
# install torch from PyTorch's CPU index first (README, "Install").
python -m pip install -q -e ".[test]"
python -c "import torch; print(f'== torch {torch.__version__}')"

# Compile the C++ core and the test-only module once, up front, so that no test's
# deadline pays for them; a compiler warning fails the run.
bash scripts/build_core.sh python --with-tests

# -rs: the summary lists every skipped test with its reason (without a GPU the CUDA
# tests skip; a green run must still say what it did not run).
python -m pytest -q -rs tests "$@"

if [[ "${COMPAT_TORCH:-}" != none ]]; then
    bash scripts/compat_check.sh
fi
