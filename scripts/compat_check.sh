#!/usr/bin/env bash
# Compatibility check against the oldest torch pyproject.toml declares, in a virtual
# environment of its own made here (removed at the end): torch ${COMPAT_TORCH:-2.11.0}
# from pip's index (on Linux the CUDA build and its CUDA wheels, about 5 GB; a CUDA
# build of torch does not import without them), a regular (not editable) install of
# this checkout, the C++ core compiled against that torch (without a warning), and
# tests/compat_smoke.py on 2 simulated machines x 2 ranks, then the tests of the logic
# that differs most between torch releases (LOGIC_TESTS: the sub-group path's life cycle
# with torch's Work and getError, the CUDA decisions, the engine's exact results at 2x2),
# run from this checkout with that torch. The tests that need the test-only native module
# (the stream vehicle, the plans, the fault points) run on the newest torch only: its
# build would add a minute here (they passed on 2.11.0 on 2026-11-26, bench/results/HISTORY.md).
#
# `compat_check.sh --prepare DIR` only makes the venv in DIR and installs into it
# (network and disk, hardly any CPU); `COMPAT_WORK=DIR compat_check.sh` then checks with
# it, and removes DIR at the end. scripts/run_tests.sh prepares beside the suite and
# checks after it.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_version=${COMPAT_TORCH:-2.11.0}
LOGIC_TESTS=(
    tests/test_subgroup_lifecycle.py
    tests/test_cuda_groups.py
    "tests/test_allreduce.py::test_allreduce"
)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# Only what this venv holds: not a checkout on the path, not another build's cache.
unset PYTHONPATH

prepare() {
    local work=$1
    python3 -m venv "$work/venv"
    # torch first and alone: `pip install .` then keeps it, as it satisfies torch>=2.11.
    "$work/venv/bin/python" -m pip install -q "torch==$torch_version"
    "$work/venv/bin/python" -m pip install -q . pytest hypothesis
    touch "$work/prepared"
}

start=$SECONDS
if [[ "${1:-}" == --prepare ]]; then
    prepare "$2"
    echo "== compat check: torch $torch_version installed in a fresh venv in $((SECONDS - start)) s"
    exit 0
fi
work=${COMPAT_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/fairring-compat.XXXXXX")}
trap 'rm -rf "$work"' EXIT
if [[ ! -e "$work/prepared" ]]; then
    prepare "$work"
fi
export FAIRRING_BUILD_DIR=$work/build
py=$work/venv/bin/python
repo=$PWD
# Everything from here runs outside the checkout, so that `import fairring_pg` finds the
# installed package (and the sources it ships) every time, never the checkout's: the
# two would each build a core of their own.
cd "$work"
echo "== compat check: torch $("$py" -c 'import torch; print(torch.__version__)')" \
    "in a venv of its own ($((SECONDS - start)) s)"
bash "$repo/scripts/build_core.sh" "$py"
echo "== compat check: core built ($((SECONDS - start)) s)"
"$py" "$repo/tests/compat_smoke.py"
echo "== compat check: smoke test passed ($((SECONDS - start)) s)"
"$work/venv/bin/pytest" -q -p no:cacheprovider -rs "${LOGIC_TESTS[@]/#/$repo/}" -k "not 2x3 and not 3x1 and not 1x3 and not interleaved and not a_failed_call_fails_the_group"
echo "== compat check: done in $((SECONDS - start)) s"
