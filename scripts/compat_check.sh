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
# `compat_check.sh --prepare DIR` makes the venv in DIR, installs into it (network and
# disk) and then compiles the core there at idle priority (SCHED_IDLE: only on CPU time
# nothing else wants); `COMPAT_WORK=DIR compat_check.sh` then checks with it, and
# removes DIR at the end. scripts/run_tests.sh prepares beside the suite, whose waits
# leave about a fifth of the CPU idle, and checks after it.
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

# The core for that torch, from outside the checkout, so that `import fairring_pg` finds
# the installed package (and the sources it ships), never the checkout's: the two would
# each build a core of their own. Its output and status are kept for the check, which
# reports them (a load from the cache would not show a warning again). After DIR: the
# command that runs the build (a priority), if any.
build_core() {
    local work=$1
    shift
    local status=0
    (cd "$work" && FAIRRING_BUILD_DIR=$work/build "$@" bash "$repo/scripts/build_core.sh" \
        "$work/venv/bin/python") >"$work/build.log" 2>&1 || status=$?
    echo "$status" >"$work/build.status"
}

start=$SECONDS
repo=$PWD
if [[ "${1:-}" == --prepare ]]; then
    prepare "$2"
    echo "== compat check: torch $torch_version installed in a fresh venv in $((SECONDS - start)) s"
    # A session of its own (run_tests.sh starts it so) is a scheduling group of its own
    # where the kernel groups by session: the group's weight is lowered too, or it would
    # take its fair half of the CPU whatever its tasks' priority.
    echo 19 >/proc/self/autogroup 2>/dev/null || true
    idle=(nice -n 19)
    if chrt --idle 0 true 2>/dev/null; then idle=(chrt --idle 0); fi
    build_core "$2" "${idle[@]}"
    echo "== compat check: core compiled at idle priority by $((SECONDS - start)) s"
    exit 0
fi
work=${COMPAT_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/fairring-compat.XXXXXX")}
trap 'rm -rf "$work"' EXIT
if [[ ! -e "$work/prepared" ]]; then
    prepare "$work"
fi
if [[ ! -e "$work/build.status" ]]; then
    build_core "$work"
fi
export FAIRRING_BUILD_DIR=$work/build
py=$work/venv/bin/python
cd "$work"
echo "== compat check: torch $("$py" -c 'import torch; print(torch.__version__)')" \
    "in a venv of its own ($((SECONDS - start)) s)"
cat "$work/build.log"
if [[ $(cat "$work/build.status") != 0 ]]; then
    exit 1
fi
echo "== compat check: core built ($((SECONDS - start)) s)"
"$py" "$repo/tests/compat_smoke.py"
echo "== compat check: smoke test passed ($((SECONDS - start)) s)"
"$work/venv/bin/pytest" -q -p no:cacheprovider -rs "${LOGIC_TESTS[@]/#/$repo/}" -k "not 2x3 and not 3x1 and not 1x3 and not interleaved and not a_failed_call_fails_the_group"
echo "== compat check: done in $((SECONDS - start)) s"
