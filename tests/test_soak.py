"""The short form of scripts/soak.py: a few thousand allreduces of random sizes, dtypes,
ops and concurrency on 2 machines x 2 ranks, every result exact, and after a warm-up
no growth in descriptors or threads and at most 32 MiB in resident memory.

The full form (10,000 allreduces) is ``python scripts/soak.py``.
"""

from __future__ import annotations

import pytest
import soak_jobs as soak

SHORT_OPS = 2500  # 10-25 s on 2 cores, depending on load


def test_soak_short(capsys: pytest.CaptureFixture[str]) -> None:
    report = soak.run_soak(soak.SoakConfig(ops=SHORT_OPS, seed=1, timeout_s=240))
    with capsys.disabled():
        print("\n" + "\n".join(report.lines()))
    assert not report.failures, "\n".join(report.failures)
