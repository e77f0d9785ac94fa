#!/usr/bin/env bash
# Compile the C++ core for the Python given as $1 (default: python), or load it from
# the cache, and fail if the compiler warned: the core builds without a warning on every
# torch we test. With --with-tests as $2, the test-only module too (tests/native/,
# linked against the core), so that no test builds it under a deadline. Shows the
# build's progress lines; the compiler's output only on a warning or an error.
set -euo pipefail
py=${1:-python}
load="b.load_extension()"
if [[ "${2:-}" == --with-tests ]]; then
    native=$(cd "$(dirname "$0")/../tests/native" && pwd)
    load="b.load_extension(); b.load_test_extension('$native')"
fi
log=$(mktemp "${TMPDIR:-/tmp}/fairring-build.XXXXXX")
trap 'rm -f "$log"' EXIT
set +e
FAIRRING_BUILD_VERBOSE=1 "$py" -c "import fairring_pg._build as b; $load" 2>&1 |
    tee "$log" | grep --line-buffered "^fairring_pg"
status=${PIPESTATUS[0]}
set -e
if [[ $status -ne 0 ]]; then
    cat "$log"
    exit "$status"
fi
if grep -q "warning:" "$log"; then
    echo "== the C++ core compiled with warnings:"
    grep -B 2 -A 8 "warning:" "$log"
    exit 1
fi
