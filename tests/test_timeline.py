"""The Timeline (FAIRRING_TIMELINE) and torch.profiler ranges of fairring allreduces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from multiprocess import SHAPES, fairring_env, run_ranks

from fairring_pg.tools.timeline_command import load_trace, merge

SLICE = 64 * 1024
NUMEL = 3 * SLICE // 4 + 5  # float32: three full slices and a short one
PHASES = {"waiting for staging", "reduce-scatter", "collect", "reduce", "diffuse", "all-gather"}


def _allreduce_twice(rank: int, world_size: int) -> list[float]:
    out = []
    for _ in range(2):
        t = torch.full((NUMEL,), float(rank + 1))
        dist.all_reduce(t)
        out.append(t[0].item())
    return out


def test_timeline_records_ops_and_every_phase_of_every_slice(tmp_path: Path) -> None:
    template = str(tmp_path / "trace.json")
    env = fairring_env(slice_size=SLICE, FAIRRING_TIMELINE=template, FAIRRING_SLICE_SCALING="off")
    results = run_ranks(_allreduce_twice, 4, SHAPES["2x2"], env=env)
    assert results == [[10.0, 10.0]] * 4

    files = sorted(tmp_path.glob("trace.rank*.json"))
    assert [f.name for f in files] == [f"trace.rank{r}.json" for r in range(4)]
    slices_per_op = 4
    for rank, path in enumerate(files):
        events = json.loads(path.read_text())  # closed cleanly: strict JSON
        ops = [e for e in events if e.get("cat") == "ops"]
        assert [e["name"] for e in ops] == ["allreduce #0", "allreduce #1"]
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in ops)
        assert ops[0]["args"]["slices"] == slices_per_op
        assert ops[0]["args"]["elements"] == NUMEL
        begins = [e for e in events if e.get("cat") == "slice" and e["ph"] == "b"]
        ends = [e for e in events if e.get("cat") == "slice" and e["ph"] == "e"]
        # 2 ops x 4 slices, each with all six phases on 2 machines x 2 ranks.
        assert len(begins) == len(ends) == 2 * slices_per_op * len(PHASES)
        by_slice: dict[int, set[str]] = {}
        for e in begins:
            by_slice.setdefault(e["id"], set()).add(e["name"])
        assert len(by_slice) == 2 * slices_per_op
        assert all(names == PHASES for names in by_slice.values())
        for b, e in zip(begins, ends, strict=True):
            assert (b["id"], b["name"]) == (e["id"], e["name"]) and e["ts"] >= b["ts"]

    merged = tmp_path / "merged.json"
    count = merge(files, merged)
    events = json.loads(merged.read_text())
    assert len(events) == count == sum(len(load_trace(f)) for f in files)
    assert {e["pid"] for e in events} == {0, 1, 2, 3}


def test_timeline_shows_each_pipeline_chunk(tmp_path: Path) -> None:
    """FAIRRING_PIPELINE_CHUNK reaches the C++ core, per local rank: with L = 2 a 64 KiB
    slice in 8 KiB chunks moves as 4 segments of 2 x 8 KiB (4096 float32, a multiple of
    L*M = 4), the short last slice as 1, each through all six phases, the segments of
    an op covering every element once."""
    template = str(tmp_path / "trace.json")
    env = fairring_env(
        slice_size=SLICE,
        FAIRRING_TIMELINE=template,
        FAIRRING_SLICE_SCALING="off",
        FAIRRING_PIPELINE_CHUNK="8K",
    )
    results = run_ranks(_allreduce_twice, 4, SHAPES["2x2"], env=env)
    assert results == [[10.0, 10.0]] * 4
    for path in sorted(tmp_path.glob("trace.rank*.json")):
        begins = [e for e in json.loads(path.read_text()) if e.get("cat") == "slice"]
        begins = [e for e in begins if e["ph"] == "b"]
        rows: dict[int, set[str]] = {}
        for e in begins:
            rows.setdefault(e["id"], set()).add(e["name"])
        assert all(names == PHASES for names in rows.values())
        chunks: dict[tuple[int, int, int], int] = {}
        for e in begins:
            a = e["args"]
            chunks[(a["op"], a["slice"], a["segment"])] = a["elements"]
        assert len(rows) == len(chunks) == 2 * (3 * 4 + 1)
        for op in (0, 1):
            mine = {k[1:]: v for k, v in chunks.items() if k[0] == op}
            assert sorted(mine) == [(s, g) for s in range(3) for g in range(4)] + [(3, 0)]
            assert {mine[(s, g)] for s in range(3) for g in range(4)} == {4096}
            assert sum(mine.values()) == NUMEL


def test_load_trace_accepts_a_trace_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "cut.json"
    path.write_text(
        '[\n{"name":"a","ph":"X","ts":1,"dur":2,"pid":0},\n'
        '{"name":"b","ph":"X","ts":3,"dur":1,"pid":0},\n'
    )
    assert [e["name"] for e in load_trace(path)] == ["a", "b"]


def _profiled_allreduce(rank: int, world_size: int) -> list[str]:
    t = torch.ones(1000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
    assert t[0].item() == world_size**2
    names: list[str] = [e.name for e in prof.events()]
    return names


def test_allreduce_shows_in_torch_profiler() -> None:
    results: list[Any] = run_ranks(_profiled_allreduce, 3, SHAPES["3x1"])
    for names in results:
        assert names.count("fairring:all_reduce") == 2


def _two_groups(rank: int, world_size: int) -> list[float]:
    # The default group and a second fairring group, each with its own engine and trace.
    other = dist.new_group(backend="fairring")
    out = []
    for group, value in ((None, 1.0), (other, 1000.0)):
        t = torch.full((NUMEL,), value * (rank + 1))
        dist.all_reduce(t, group=group)
        out.append(t[0].item())
    dist.destroy_process_group(other)
    return out


def test_each_group_writes_its_own_trace(tmp_path: Path) -> None:
    # Two groups once wrote one file per rank, their events interleaved mid-line.
    template = str(tmp_path / "trace.json")
    env = fairring_env(slice_size=SLICE, FAIRRING_TIMELINE=template, FAIRRING_SLICE_SCALING="off")
    results = run_ranks(_two_groups, 4, SHAPES["2x2"], env=env)
    assert results == [[10.0, 10000.0]] * 4
    for rank in range(4):
        for name in (f"trace.rank{rank}.json", f"trace.rank{rank}.g1.json"):
            events = json.loads((tmp_path / name).read_text())  # strict JSON: one writer
            ops = [e for e in events if e.get("cat") == "ops"]
            assert [e["name"] for e in ops] == ["allreduce #0"], name
            assert ops[0]["args"]["elements"] == NUMEL
    assert len(list(tmp_path.glob("trace.*"))) == 8
