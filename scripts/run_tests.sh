#!/usr/bin/env bash
# The README's test command: install what the tests need, run the whole suite on the
# torch that is installed (multi-process CPU tests on simulated machines; CUDA tests
# skip without a GPU), then scripts/compat_check.sh: the core and the logic tests on the
# oldest torch we declare, in a venv of its own (COMPAT_TORCH=none skips that;
# COMPAT_TORCH=2.13.0 checks another release). That venv is installed beside the suite
# (its 5 GB wait on the network and the disk while the suite uses the CPU), and its
# core compiled there at idle priority, on what CPU time the suite leaves.
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
compat_work=""
if [[ "${COMPAT_TORCH:-}" != none ]]; then
    compat_work=$(mktemp -d "${TMPDIR:-/tmp}/fairring-compat.XXXXXX")
    # A session of its own, so that an early exit stops its compiler too.
    setsid bash scripts/compat_check.sh --prepare "$compat_work" >"$compat_work.log" 2>&1 &
    prepare=$!
    trap 'kill -- -"$prepare" 2>/dev/null || true; wait "$prepare" 2>/dev/null || true; rm -rf "$compat_work" "$compat_work.log"' EXIT
fi

# An installed torch (CPU or CUDA build) is kept. Without one, pip brings the newest
# release it resolves torch>=2.11 to, as a user's `pip install .` does: from PyPI on
# Linux the CUDA build (several GB of CUDA wheels). For the small CPU-only build,
# install torch from PyTorch's CPU index first (README, "Install").
python -m pip install -q -e ".[test]"
python -c "import torch; print(f'== torch {torch.__version__}')"
echo "== installed in ${SECONDS} s"

# Compile the C++ core and the test-only module once, up front, so that no test's
# deadline pays for them; a compiler warning fails the run.
bash scripts/build_core.sh python --with-tests
echo "== core built at ${SECONDS} s"

# -rs: the summary lists every skipped test with its reason (without a GPU the CUDA
# tests skip; a green run must still say what it did not run); --durations: the
# slowest, for whoever keeps this command under its 30 minutes.
python -m pytest -q -rs --durations=25 tests "$@"
echo "== suite done at ${SECONDS} s"

# Every plant (a known bug of the CUDA path, put back by a test-only switch) must be
# caught by the tests that are there for it (tests/stream_mutants.py).
bash scripts/stream_mutants.sh
echo "== mutants done at ${SECONDS} s"

if [[ -n "$compat_work" ]]; then
    if ! wait "$prepare"; then
        echo "== compat check: installing torch ${COMPAT_TORCH:-2.11.0} failed:"
        cat "$compat_work.log"
        exit 1
    fi
    cat "$compat_work.log"
    COMPAT_WORK=$compat_work bash scripts/compat_check.sh
fi
echo "== all done in ${SECONDS} s"
