#!/usr/bin/env bash
# Every plant (src/faults/plants.h: a test-only switch that puts a known bug of the CUDA
# path back) armed in turn, with the tests that must catch it: prints
# "NAME: caught by TEST" or "NAME: NOT CAUGHT" per plant and exits non-zero if any was
# not caught (tests/stream_mutants.py). Part of the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python tests/stream_mutants.py "$@"
