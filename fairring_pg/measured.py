"""The measured choice's record (src/measured/, ``FAIRRING_*_ALLREDUCE=auto``): each
decision said once in the log, readable from Python, and kept in ``FAIRRING_PLAN_FILE``
for a later job of the same shape.

A decision is a dict: ``device`` ("cpu", "cuda"), the size class (``from_bytes``,
``to_bytes``: exclusive, None for no end), the two ``ways`` (``("engine", "ring")``,
``("nccl", "composed")``), per way the slowest rank's ``seconds`` for a timed call at its
median speed and those calls' mean ``bytes``, the ``winner``, the ``trial_calls`` it cost and its
``source`` ("measured", "plan file", or "kept": some rank could not time its trial calls,
``reason`` says which and why, and every rank keeps the program's own way; logged as a
warning, never saved).

The plan file: rank 0 of the group reads it when the group is made and publishes what it
holds through the store, so every rank starts from the same decisions (a class decided
there runs its winner from its first call, without trials); rank 0 writes the file again,
whole, after each new decision. The file names the shape its decisions depend on
(:func:`job_shape`): machines and ranks; the settings that change what either way does;
what the machines are made of (the node facts the CUDA plan is built from, the NICs'
rates, the GPUs' models, SMs and memory, the CPU cores); the torch and NCCL versions; the
CPU and CUDA delegates; the plans' rows. A file made under another shape is an error on
every rank at ``init_process_group``, naming the field, the file's value and this job's:
ignoring it would rerun the trials unnoticed, and saving this job's decisions would
destroy the other job's; taking it as it is would run another cluster's winners. One
difference only warns: a torch a patch release apart (2.4.0 and 2.4.1, the same build
tag), whose NCCL is compared on its own. A patch release fixes bugs and keeps Gloo and
the collectives' code paths; refusing it would make a routine upgrade of the cluster's
torch fail every job that names the file at its start. A group other than the default
one keeps its own file (``plan.json`` -> ``plan.g3.json`` for group 3).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from fairring_pg.config import Config, file_for_group
from fairring_pg.cuda.decision import GpuFacts
from fairring_pg.cuda.node_facts import UNKNOWN, NodeFacts
from fairring_pg.model.cpu_plan import CpuPlan
from fairring_pg.model.cuda_plan import CudaPlan
from fairring_pg.process_groups import CPU_DELEGATE
from fairring_pg.startup import wait_for
from fairring_pg.topology import Topology

# /2: the shape names the machines, the delegates and the torch and NCCL versions.
FORMAT = "fairring-plan-file/2"
# The calls of trials each measured class costs (src/measured/trial_order.h's
# kDecisionCall): blocks of three calls of one way, A B B A, the first of each untimed;
# the next call decides.
TRIAL_CALLS = 12
VARIABLE = "FAIRRING_PLAN_FILE"
_KEY = "fairring/measured/known"
_log = logging.getLogger("fairring_pg")


def job_shape(
    topology: Topology,
    config: Config,
    cpu_plan: CpuPlan,
    cuda_plan: CudaPlan,
    facts: Sequence[GpuFacts],
    cuda_delegate: str,
    sub_group_ctas: int,
) -> dict[str, Any]:
    """What a plan file must have been saved under to fit this job, in the order a
    misfit is looked for (causes before the plans they shape): its size, the settings,
    what its machines are made of and run, from ``facts`` (every rank's, as published:
    the same on every rank), the delegates (``cuda_delegate``: the CUDA decision's), the
    sub-group communicators' CTA cap and the plans' rows. JSON's values, as the file
    holds them."""
    nodes = [NodeFacts.from_json(f.node) if f.node else UNKNOWN for f in facts]
    shape = {
        "world_size": topology.world_size,
        "machines": topology.num_machines,
        "local_size": topology.local_size,
        "settings": config.plan_shaping(),
        "node": _agreed([_node(n) for n in nodes]),
        "link_rates": _agreed([_rates(n) for n in nodes]),
        "gpu_models": _agreed([list(f.gpu_models) if f.cuda else None for f in facts]),
        "gpu_sms": _agreed([f.sms if f.cuda else None for f in facts]),
        "gpu_memory": _agreed([f.gpu_memory if f.cuda else None for f in facts]),
        "cpu_cores": _agreed([f.cores for f in facts]),
        "torch_version": _agreed([f.torch for f in facts]),
        "nccl_version": _agreed([f.nccl_version for f in facts]),
        "cpu_delegate": CPU_DELEGATE,
        "cuda_delegate": cuda_delegate,
        "sub_group_ctas": sub_group_ctas,
        "cpu_rows": [list(row) for row in cpu_plan.core_rows()],
        "cuda_rows": [list(row) for row in cuda_plan.core_rows()],
    }
    result: dict[str, Any] = json.loads(json.dumps(shape))
    return result


def _agreed(values: Sequence[Any]) -> Any:
    """One fact of every rank's: its value where all ranks' are equal, else
    ``{"differ": [each distinct value]}`` (None: no rank)."""
    distinct = {json.dumps(v, sort_keys=True): v for v in values}
    if len(distinct) <= 1:
        return next(iter(distinct.values()), None)
    return {"differ": [distinct[key] for key in sorted(distinct)]}


def _node(facts: NodeFacts) -> dict[str, Any]:
    """The facts the CUDA plan's model takes (fairring_pg.cuda.node_facts), whatever
    their source; the NICs' rates are ``link_rates``. In the order the file keeps."""
    return {
        "arch": facts.arch,
        "cpu": facts.cpu,
        "intra": facts.intra,
        "nvlink": facts.nvlink,
        "nvls": facts.nvls,
    }


def _rates(facts: NodeFacts) -> list[str] | None:
    """The nominal rate of each NIC NCCL would use, fastest first; None where unknown."""
    return [f"{rate * 8 / 1e9:g} Gbit/s" for rate in facts.nic_rates] or None


def _differences(theirs: Any, shape: dict[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """(field, the file's value, this job's) for each field of ``shape`` the file's
    shape ``theirs`` holds otherwise; a setting as ``settings.<name>``."""
    saved = theirs if isinstance(theirs, dict) else {}
    for field, mine in shape.items():
        if field == "settings":
            settings = saved.get("settings")
            settings = settings if isinstance(settings, dict) else {}
            for name, value in mine.items():
                if settings.get(name) != value:
                    yield f"settings.{name}", settings.get(name), value
        elif saved.get(field) != mine:
            yield field, saved.get(field), mine


_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)(\+[\w.]+)?")


def _tolerated(field: str, theirs: Any, mine: Any) -> bool:
    """Whether a file that differs from this job only so is kept, with a warning: a
    torch a patch release apart, with the same build tag (``2.4.0+cu121`` and
    ``2.4.1+cu121``; NCCL's version is a field of its own). See the module's docstring."""
    if field != "torch_version" or not (isinstance(theirs, str) and isinstance(mine, str)):
        return False
    a, b = _RELEASE.fullmatch(theirs), _RELEASE.fullmatch(mine)
    if a is None or b is None:
        return False
    return (a[1], a[2], a[4]) == (b[1], b[2], b[4]) and a[3] != b[3]


def _misfit(path: str, saved: Any, shape: dict[str, Any]) -> str | None:
    """Why the file's content ``saved`` does not fit ``shape``, or None: the first field
    that differs (but for :func:`_tolerated` ones), with the file's value and this job's."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        return f"it is not a plan file of this version (expected format {FORMAT!r})"
    for field, theirs, mine in _differences(saved.get("shape"), shape):
        if _tolerated(field, theirs, mine):
            continue
        if field.startswith("settings."):
            name = field.removeprefix("settings.")
            return f"it was saved with {name}={theirs!r}, this job has {mine!r}"
        return f"its {field} is {theirs!r}, this job's is {mine!r}"
    return None


def read_known(path: str, shape: dict[str, Any]) -> list[dict[str, Any]]:
    """The decisions the plan file at ``path`` holds (none if it does not exist yet).
    Raises ValueError, naming the variable and what differs, where it does not fit."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    try:
        saved = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{VARIABLE}={path!r} is not a plan file: {exc}") from None
    why = _misfit(path, saved, shape)
    if why is not None:
        raise ValueError(
            f"{VARIABLE}={path!r} holds the decisions of another job: {why}; expected a file "
            "saved by a job of the same shape (name another file, or delete this one to "
            "measure again)"
        )
    for field, theirs, mine in _differences(saved.get("shape"), shape):  # all tolerated
        warnings.warn(
            f"fairring: {VARIABLE}={path!r} was saved with {field} {theirs!r}, this job has "
            f"{mine!r}: a patch release apart, so its decisions are kept (the file takes "
            "this job's with its next decision; delete it to measure again)",
            RuntimeWarning,
            stacklevel=2,
        )
    return list(saved.get("decisions", []))


def agree_on_known(
    store: Any, rank: int, timeout: timedelta, config: Config, shape: dict[str, Any], group: str
) -> list[dict[str, Any]]:
    """The plan file's decisions, the same on every rank: rank 0 reads the file and
    publishes them, or the reason it does not fit, which every rank then raises."""
    if config.plan_file is None:
        return []
    if rank == 0:
        try:
            published: dict[str, Any] = {
                "known": read_known(file_for_group(config.plan_file, group), shape)
            }
        except ValueError as exc:
            published = {"error": str(exc)}
        store.set(_KEY, json.dumps(published))
    wait_for(store, [_KEY], timeout, "waiting for rank 0's reading of FAIRRING_PLAN_FILE", [0])
    published = json.loads(store.get(_KEY))
    if "error" in published:
        raise ValueError(published["error"])
    return list(published["known"])


def describe(decision: dict[str, Any], machines: int, local_size: int) -> str:
    """One log line for a decision."""
    ways, seconds, size = decision["ways"], decision["seconds"], decision["bytes"]
    end = decision["to_bytes"]
    span = (
        f"{decision['from_bytes']} B and up"
        if end is None
        else (f"{decision['from_bytes']}-{end - 1} B")
    )
    times = ", ".join(
        f"{way} {s * 1e3:.3f} ms ({b / 2**20:.3g} MiB)"
        for way, s, b in zip(ways, seconds, size, strict=True)
    )
    return (
        f"fairring: measured {decision['device']} allreduces of {span} at {machines} x "
        f"{local_size}: {times} per call (the slowest rank's median of "
        f"{decision['timed_calls']} each); {decision['winner']} from call "
        f"{decision['trial_calls']} on"
    )


def describe_kept(decision: dict[str, Any], machines: int, local_size: int) -> str:
    """One log line for a class that keeps the program's own way because some rank
    could not time its trial calls."""
    end = decision["to_bytes"]
    span = (
        f"{decision['from_bytes']} B and up"
        if end is None
        else f"{decision['from_bytes']}-{end - 1} B"
    )
    return (
        f"fairring: the measured choice of {decision['device']} allreduces of {span} at "
        f"{machines} x {local_size} could not compare the ways: {decision['reason']}; every "
        f"rank runs {decision['winner']} (the program's own way) from call "
        f"{decision['trial_calls']} on"
    )


class Recorder:
    """Rank 0's hook for new decisions (src/measured/'s onDecision): says each once in
    the log and keeps the plan file, if any, up to date."""

    def __init__(
        self, topology: Topology, shape: dict[str, Any], path: str | None, known: list[Any]
    ) -> None:
        self._machines, self._local = topology.num_machines, topology.local_size
        self._shape = shape
        self._path = path
        self._decisions = {(d["device"], d["from_bytes"]): d for d in known}

    def __call__(self, device: str, decision_json: str) -> None:
        decision = json.loads(decision_json)
        if decision["source"] == "kept":
            # Not saved: a later job measures again.
            _log.warning(describe_kept(decision, self._machines, self._local))
            return
        _log.info(describe(decision, self._machines, self._local))
        self._decisions[(device, decision["from_bytes"])] = {
            **decision,
            "source": "plan file",
            "trial_calls": 0,
            "timed_calls": 0,
        }
        if self._path is not None:
            self._save()

    def _save(self) -> None:
        assert self._path is not None
        content = {
            "format": FORMAT,
            "shape": self._shape,
            "decisions": [self._decisions[key] for key in sorted(self._decisions)],
        }
        directory = os.path.dirname(os.path.abspath(self._path))
        fd, tmp = tempfile.mkstemp(prefix=".fairring-plan-", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, self._path)  # a reader sees the old file or the new, never half


def set_known(opts: Any, known: list[dict[str, Any]]) -> None:
    """Hand the plan file's decisions to the core."""
    for d in known:
        opts.add_measured_known(
            d["device"],
            int(d["from_bytes"]),
            list(d["ways"]).index(d["winner"]),
            [float(s) for s in d["seconds"]],
            [float(b) for b in d["bytes"]],
        )


def decisions_of(backend: Any, devices: tuple[str, ...]) -> list[dict[str, Any]]:
    """The decisions the core's ``backend`` has for ``devices``' allreduces so far."""
    return [json.loads(d) for device in devices for d in backend.measured_choices(device)]
