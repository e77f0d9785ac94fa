#!/usr/bin/env python
"""The CUDA path's random programs as a command. The runner is test machinery and lives with
the tests that keep its seeds: tests/cuda_fuzz_jobs.py says what it does and how to run it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cuda_fuzz_jobs import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
