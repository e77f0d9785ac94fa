"""MPICH beside Gloo in bench/allreduce_sizes.py (bench/mpi_allreduce.py): the table's
"mpi ms" and "vs MPI" columns from made-up times, the reason where MPI did not run, the
simulated machines MPICH is told of, and (where mpi4py and MPICH are installed: `pip
install -e .[bench]`) a real two-rank run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def sizes_bench() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import allreduce_sizes

        yield allreduce_sizes
    finally:
        sys.path.remove(str(BENCH))


def _run(mpi: dict[str, Any]) -> dict[str, Any]:
    # Medians: Gloo 4 ms, fairring 2 ms, MPICH 0.5 ms at 4 KiB; MPICH 5 ms at 1 MiB.
    return {
        "world": 2,
        "sizes": {
            "4096": {"reps": 50, "gloo": [3e-3, 4e-3, 9e-3], "fairring": [1e-3, 2e-3, 2.5e-3]},
            "1048576": {"reps": 4, "gloo": [8e-3] * 3, "fairring": [4e-3, 4e-3, 5e-3]},
        },
        "mpi": mpi,
    }


def test_the_mpi_column_is_mpichs_median_over_fairrings(sizes_bench: Any) -> None:
    mpi = {"sizes": {"4096": [0.4e-3, 0.5e-3, 7e-3], "1048576": [5e-3, 6e-3, 4e-3]}}
    rows = sizes_bench.summarize(_run(mpi))
    assert [r["mpi_s"] for r in rows] == [0.5e-3, 5e-3]
    assert [r["vs_mpi"] for r in rows] == [0.25, 1.25]
    table = sizes_bench._table(rows)
    head, _, small, large = table.strip().splitlines()
    assert "| mpi ms |" in head and head.endswith("| vs MPI |")
    assert small.startswith("| 4 KiB | 4.000 | 2.000 | 0.500 |") and small.endswith("| 0.25x |")
    assert large.endswith("| 1.25x |")


def test_without_mpi_the_table_says_why(sizes_bench: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    why = "mpi4py is not installed (pip install mpi4py mpich (or: pip install -e .[bench]))"
    rows = sizes_bench.summarize(_run({"error": why}))
    assert all("mpi_s" not in r for r in rows)
    assert "mpi" not in sizes_bench._table(rows)
    data = {
        "stamp": {"config": {"where": "loopback"}},
        "runs": {"1x2": _run({"error": why})},
    }
    monkeypatch.setattr(sizes_bench.report, "stamp_lines", lambda stamp: "")
    text, _ = sizes_bench.render(data)
    assert f"MPI: {why}." in text


def test_simulated_machines_are_mpich_cliques_talking_tcp(sizes_bench: Any) -> None:
    mpi = sizes_bench.mpi_allreduce
    assert mpi.environment(1) == {"OMP_NUM_THREADS": "1"}
    assert mpi.environment(3) == {
        "OMP_NUM_THREADS": "1",
        "MPIR_CVAR_NUM_CLIQUES": "3",
        "MPIR_CVAR_CLIQUES_BY_BLOCK": "1",
        "UCX_TLS": "tcp,self",
    }


def test_a_real_run_where_mpich_is_installed(sizes_bench: Any) -> None:
    mpi = sizes_bench.mpi_allreduce
    why = mpi.unavailable()
    if why is not None:
        pytest.skip(why)
    got = mpi.run(1, 2, [4096, 65536], [3, 2], iters=4, warmup=1)
    assert set(got["sizes"]) == {"4096", "65536"}, got
    assert all(len(v) == 4 and all(0 < t < 1 for t in v) for v in got["sizes"].values()), got
