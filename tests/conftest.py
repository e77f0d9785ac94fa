"""What every test module shares: the helper modules beside this file on the path (the
launcher, multiprocess.py; inputs and references, values.py; Gloo references,
reference.py), and one random seed per session, printed in the header and again after
any failure."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

# Tests that draw random timings or inputs derive them from this (test_completion's
# delays); FAIRRING_TEST_SEED=N replays a run. Set here, before any test module is
# imported, so that rank processes (which inherit the environment) agree.
SESSION_SEED = int(os.environ.get("FAIRRING_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
os.environ["FAIRRING_TEST_SEED"] = str(SESSION_SEED)


def pytest_report_header(config: pytest.Config) -> str:
    return f"FAIRRING_TEST_SEED={SESSION_SEED} (set it to replay this run's random timings)"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        terminalreporter.write_line(
            f"random timings of this run: FAIRRING_TEST_SEED={SESSION_SEED} replays them"
        )
