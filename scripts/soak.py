#!/usr/bin/env python
"""The soak as a command. The runner is test machinery and lives with
the tests that keep its seeds: tests/soak_jobs.py says what it does and how to run it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from soak_jobs import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
