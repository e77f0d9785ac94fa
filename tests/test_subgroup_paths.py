"""Which path each allreduce of the sub-group allreduce takes, per shape, mode
(FAIRRING_CUDA_ALLREDUCE) and size, from the path's counters
(``fairring_pg.group_info.subgroup_stats``): on CPU here (FAIRRING_TEST_CPU_SUBGROUPS=on),
and on the GPU through tests/test_cuda.py, which uses the same checks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import SHAPES, run_ranks
from test_allreduce import (
    Case,
    make_input,
    reduce_exact,
)
from test_subgroups import TIMEOUT_S, subgroup_env
from values import compare_exact, reduce_op

from fairring_pg.group_info import subgroup_stats

# ------------------------------------------------- which path, per shape, mode and size

# A multiple of 16*L*M bytes for every shape below (32, 64, 64, 48, 96), so that a slice
# is the same 1200 four-byte (600 float64, 2400 bfloat16) elements everywhere.
PATH_SLICE = 4800
PATH_DIRECT_BELOW = 16 * 1024  # bytes
PATH_SHAPES = {
    "2x1": ["m0", "m1"],
    "4x1": ["m0", "m1", "m2", "m3"],
    "2x2": SHAPES["2x2"],
    "1x3": SHAPES["1x3"],
    "2x3": SHAPES["2x3"],
}
PATH_MODES = ("auto", "lanes", "direct")
# (op, dtype, bytes per element as the sub-groups reduce it: int16 travels as int32)
PATH_KINDS = (
    ("SUM", "float32", 4),
    ("MAX", "float64", 8),
    ("SUM", "bfloat16", 2),
    ("PRODUCT", "int16", 4),
)
# Empty; fewer elements than ranks; under PATH_DIRECT_BELOW in every dtype; over it in
# every dtype, with and without a tail of fewer elements than a group.
PATH_SIZES = (0, 2, 1000, 8400, 20_003)


def expected_route(
    mode: str, machines: int, local: int, numel: int, elem: int
) -> tuple[str, tuple[int, int]]:
    """Where an allreduce should go, from the rule as documented, and its (direct tail,
    pieces) units where it composes: a plan composes only with several machines, where
    FAIRRING_CUDA_ALLREDUCE=lanes asks for it (auto composes only where the model
    predicts a win, from the node's facts, which this job declares unknown:
    FAIRRING_NODE=none), and then "composed" from PATH_DIRECT_BELOW and one group of L·M
    x 16 bytes, in as many pieces as keep each under the largest (FAIRRING_SLICE_SIZE),
    the rest of a group a direct tail; a call of a plan that composes is otherwise the
    delegate's ("delegated"), and every call of one that composes nothing
    ("delegate-only": no sub-group path at all)."""
    if machines == 1 or mode != "lanes":
        return "delegate-only", (0, 0)
    group = local * machines * max(1, 16 // elem)
    if numel * elem < PATH_DIRECT_BELOW or numel < group:
        return "delegated", (0, 0)
    groups, tail = divmod(numel, group)
    fit = max(1, PATH_SLICE // (elem * group))
    return "composed", (int(tail != 0), -(-groups // fit))


def paths_taken(rank: int, world: int, device: str = "cpu") -> list[dict[str, Any]]:
    """One fairring group per mode; every size and kind once on each, with the path's
    counters read around it and the result checked exactly (or the delegate's error
    kept). ``device`` "cuda" runs the same on the GPU (tests/test_cuda.py)."""
    import os

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    records = []
    for mode in PATH_MODES:
        os.environ["FAIRRING_CUDA_ALLREDUCE"] = mode
        group = dist.new_group(backend="fairring")
        for op, dtype, elem in PATH_KINDS:
            for numel in PATH_SIZES:
                case = Case(f"path/{mode}/{op}-{dtype}-n{numel}", "plain", op, dtype, numel)
                inputs = [make_input(r, case, numel, world) for r in range(world)]
                tensor = inputs[rank].clone().to(dev)
                before = subgroup_stats(group, device)
                try:
                    dist.all_reduce(tensor, op=reduce_op(op), group=group)
                    error = compare_exact(tensor.cpu(), reduce_exact(inputs, op, dtype), "result")
                    raised = None
                except Exception as exc:  # noqa: BLE001 - the delegate's refusal is kept
                    error, raised = None, f"{type(exc).__name__}: {exc}"
                after = subgroup_stats(group, device)
                if before is None or after is None:
                    route, units = "delegate-only", (0, 0)
                else:
                    delegated = after["nccl_calls"] - before["nccl_calls"]
                    route = "delegated" if delegated else "composed"
                    units = (
                        after["direct_units"] - before["direct_units"],
                        after["sliced_units"] - before["sliced_units"],
                    )
                records.append(
                    {
                        "mode": mode,
                        "case": case.id,
                        "dtype": dtype,
                        "numel": numel,
                        "elem": elem,
                        "error": error,
                        "raised": raised,
                        "route": route,
                        "units": units,
                    }
                )
    return records


def path_env(**extra: str | int | None) -> dict[str, str | None]:
    """The paths job's settings: PATH_SLICE, PATH_DIRECT_BELOW, each group's mode set by
    the job."""
    return {
        **subgroup_env(
            FAIRRING_SLICE_SIZE=PATH_SLICE,
            FAIRRING_DIRECT_BELOW=PATH_DIRECT_BELOW,
            FAIRRING_CUDA_ALLREDUCE=None,
            FAIRRING_NODE="none",
        ),
        **{k: None if v is None else str(v) for k, v in extra.items()},
    }


def check_paths(shape: str, machine_ids: list[str], per_rank: list[list[dict[str, Any]]]) -> None:
    """Every call where the rule sends it, with the units it says; composed calls
    exact; the delegate's exact too, but for int16, which neither Gloo nor NCCL reduces
    (they refuse it, and so does fairring there)."""
    machines = len(set(machine_ids))
    local = len(machine_ids) // machines
    for rank, records in enumerate(per_rank):
        assert len(records) == len(PATH_MODES) * len(PATH_KINDS) * len(PATH_SIZES)
        for r in records:
            where = f"rank {rank}, {shape}, {r['case']}"
            route, units = expected_route(r["mode"], machines, local, r["numel"], r["elem"])
            assert r["route"] == route, f"{where}: went {r['route']}, want {route}"
            if route == "composed":
                assert r["units"] == units, f"{where}: (direct, sliced) {r['units']}, want {units}"
            assert r["error"] is None, f"{where}: {r['error']}"
            refused = route != "composed" and r["dtype"] == "int16"
            assert (r["raised"] is not None) == refused, f"{where}: raised {r['raised']}"
    composed = {r["mode"] for r in per_rank[0] if r["route"] == "composed"}
    assert composed == (set() if machines == 1 else {"lanes"}), shape


@pytest.mark.parametrize("shape", list(PATH_SHAPES))
def test_path_per_shape_mode_and_size(shape: str) -> None:
    """With the node's facts unknown, `auto` leaves every size to the delegate's own
    allreduce, as `direct` does; `lanes` composes from FAIRRING_DIRECT_BELOW up on
    several machines, at one rank per machine (2x1, 4x1) too; one machine (1x3) never
    does. The same on every rank, and every result exact."""
    ids = PATH_SHAPES[shape]
    per_rank = run_ranks(paths_taken, len(ids), ids, env=path_env(), timeout_s=TIMEOUT_S)
    check_paths(shape, ids, per_rank)
