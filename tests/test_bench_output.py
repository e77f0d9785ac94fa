"""Where the benchmarks write: --out when given, else a folder git ignores; the committed
bench/results/ only when asked (--out bench/results). The benchmarks themselves need
the `bench` extra (matplotlib); their shared bench/common.py does not."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def common() -> Any:
    spec = importlib.util.spec_from_file_location("bench_common", REPO / "bench" / "common.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _ignored(path: str) -> bool:
    done = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
    assert done.returncode in (0, 1), f"git check-ignore failed on {path}"
    return done.returncode == 0


def test_default_output_is_ignored_and_committed_results_are_not(common: Any) -> None:
    default = common.DEFAULT_OUT.relative_to(REPO)
    assert common.DEFAULT_OUT != common.RESULTS
    assert _ignored(f"{default}/allreduce_sizes.json")
    assert _ignored(f"{common.RAW.relative_to(REPO)}/allreduce_sizes_2x2.json")
    assert not _ignored("bench/results/allreduce_sizes.json")


def test_out_option(common: Any) -> None:
    p = argparse.ArgumentParser()
    common.add_output_args(p)
    assert p.parse_args([]).out == common.DEFAULT_OUT
    args = p.parse_args(["--out", "bench/results", "--raw-out", "r.json"])
    assert (args.out, args.raw_out) == (Path("bench/results"), Path("r.json"))


def test_results_go_where_out_says(common: Any, tmp_path: Path) -> None:
    def render(data: dict[str, Any]) -> tuple[str, Any]:
        return f"# {data['benchmark']}: {data['value']}\n", lambda path: path.write_bytes(b"png")

    out = tmp_path / "nested" / "out"
    common.stamp_and_save("demo", "demo_where", {"shape": "2x2"}, render, {"value": 7}, out)
    data = json.loads((out / "demo_where.json").read_text())
    assert (data["benchmark"], data["value"]) == ("demo", 7)
    assert data["stamp"]["config"] == {"shape": "2x2"}
    assert (out / "demo_where.md").read_text() == "# demo: 7\n"
    assert (out / "demo_where.png").read_bytes() == b"png"
    assert sorted(p.name for p in out.iterdir()) == [
        "demo_where.json",
        "demo_where.md",
        "demo_where.png",
    ]
    assert not list(common.RESULTS.glob("demo_where.*"))
