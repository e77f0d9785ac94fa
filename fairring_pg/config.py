"""The settings table: every ``FAIRRING_*`` variable the package reads (and
``TP_SOCKET_IFNAME``), one row each in ``Config``: the variable, its type, parser and
default, whether every rank must agree, what it does (the README's table is made from
these rows, tests/test_settings_table.py checks it), where the C++ core takes it
(``core``), and whether a saved plan file depends on it (``shapes_plan``).

Each bad value is a ``ValueError`` naming the variable, the value and what is accepted,
raised at ``init_process_group`` (the build variables: when the core loads) rather than
somewhere deep in the data path.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from fractions import Fraction
from typing import Any

from fairring_pg import congestion, sizing
from fairring_pg.sizing import GIB, KIB, MIB, TIB

DEFAULT_SLICE_SIZE = 25 * MIB  # DDP's default bucket, so one bucket is one slice
DEFAULT_TOTAL_MEMORY = 50 * MIB
# Measured on 4x1 at 1 Gbit/s (bench/results/HISTORY.md).
DEFAULT_PIPELINE_CHUNK = 1 * MIB
CUDA_DELEGATES = ("auto", "nccl", "gloo")
# From a sweep of 1, 2, 4, 8 lanes at 4x1 on an H100 (bench/results/cuda/).
DEFAULT_LANES = 2
MAX_LANES = 16
# From the same runs: below it the five steps lost to one NCCL allreduce.
DEFAULT_DIRECT_BELOW = 2 * MIB
CPU_ALLREDUCE_PATHS = ("auto", "model", "engine", "gloo")
CUDA_ALLREDUCE_PATHS = ("auto", "model", "lanes", "direct")
MAX_BYTES = TIB  # anything larger is a typo, not a configuration
__all__ = ["GIB", "KIB", "MIB", "TIB", "Config", "parse_byte_size"]

_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?|\.\d+)\s*([kmg]?)(i?b)?$", re.IGNORECASE)
_SUFFIX = {"": 1, "k": KIB, "m": MIB, "g": GIB}
_SIZE_HELP = (
    "expected a positive integer number of bytes, optionally with a K/M/G suffix "
    "(powers of 1024, case-insensitive, optional 'B' or 'iB': 25M, 25MiB, 512k, 1G); "
    "a fraction is accepted only if it comes to a whole number of bytes (1.5K)"
)
_SWITCH = {"on": True, "off": False}

_STORE_KEY = "fairring/config/{rank}"


def parse_byte_size(name: str, raw: str) -> int:
    """Parse ``raw`` (the value of variable ``name``) as a byte count in [1, 1 TiB]."""
    match = _SIZE_RE.match(raw.strip())
    if match is None and raw.strip().startswith("-"):
        raise ValueError(f"{name}={raw!r} must be positive: {_SIZE_HELP}")
    if match is None:
        raise ValueError(f"{name}={raw!r} is not a byte size: {_SIZE_HELP}")
    number, suffix, unit = match.groups()
    if unit is not None and unit.lower() == "ib" and not suffix:
        raise ValueError(f"{name}={raw!r} is not a byte size: {_SIZE_HELP}")
    value = Fraction(number) * _SUFFIX[suffix.lower()]
    if value.denominator != 1:
        raise ValueError(
            f"{name}={raw!r} is not a whole number of bytes ({float(value)}): {_SIZE_HELP}"
        )
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive: {_SIZE_HELP}")
    if value > MAX_BYTES:
        raise ValueError(f"{name}={raw!r} is larger than the accepted maximum of 1 TiB ({TIB})")
    return int(value)


def interface_ipv4(ifname: str) -> str | None:
    """The IPv4 address of network interface ``ifname``, or None if it has none."""
    siocgifaddr = 0x8915  # <linux/sockios.h>
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("256s", ifname.encode()[:15])
        try:
            reply = fcntl.ioctl(sock.fileno(), siocgifaddr, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])  # sockaddr_in.sin_addr inside struct ifreq


def interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def _check_ifname(name: str, raw: str) -> str:
    _non_empty(name, raw)
    ifname = raw.strip()
    available = interface_names()
    if ifname not in available:
        raise ValueError(
            f"{name}={raw!r} is not a network interface of this machine: "
            f"expected one of {', '.join(available)}"
        )
    if interface_ipv4(ifname) is None:
        raise ValueError(
            f"{name}={raw!r} has no IPv4 address: expected an interface with one "
            "(fairring listens on IPv4)"
        )
    return ifname


def _non_empty(name: str, raw: str) -> str:
    value = raw.strip()
    if not value:
        raise ValueError(f"{name}={raw!r} is empty: expected a non-empty string, or leave it unset")
    return value


def _switch(name: str, raw: str) -> bool:
    try:
        return _SWITCH[raw.strip().lower()]
    except KeyError:
        raise ValueError(f"{name}={raw!r} is not a switch: expected 'on' or 'off'") from None


def _count(low: int, high: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        text = raw.strip()
        if not re.fullmatch(r"\d+", text) or not low <= int(text) <= high:
            raise ValueError(
                f"{name}={raw!r} is not valid: expected a whole number from {low} to {high}"
            )
        return int(text)

    return parse


def _choice(accepted: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in accepted:
            raise ValueError(f"{name}={raw!r} is not valid: expected one of {', '.join(accepted)}")
        return value

    return parse


def file_for_group(path: str, group_name: str) -> str:
    """A file of group ``group_name``'s own: ``path`` for the default group ("0"), else
    the group's name before the extension (plan.json -> plan.g3.json)."""
    if group_name == "0":
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.g{group_name}{ext}"


def _size_or_zero(name: str, raw: str) -> int:
    return 0 if raw.strip() == "0" else parse_byte_size(name, raw)


def _check_timeline(name: str, raw: str) -> str:
    path = _non_empty(name, raw)
    directory = os.path.dirname(os.path.abspath(path.replace("{rank}", "0")))
    if not os.path.isdir(directory):
        raise ValueError(
            f"{name}={raw!r}: the directory {directory!r} does not exist; expected a file path "
            "in an existing, writable directory ('{rank}' in it is replaced by the rank)"
        )
    if not os.access(directory, os.W_OK):
        raise ValueError(f"{name}={raw!r}: the directory {directory!r} is not writable")
    return path


def _check_plan_file(name: str, raw: str) -> str:
    path = _non_empty(name, raw)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(
            f"{name}={raw!r}: the directory {directory!r} does not exist; expected a file path "
            "in an existing, writable directory (the file itself is made by the first job)"
        )
    if not os.access(directory, os.W_OK):
        raise ValueError(f"{name}={raw!r}: the directory {directory!r} is not writable")
    return path


def _verbose(name: str, raw: str) -> bool:
    if raw.strip() not in ("", "0", "1"):
        raise ValueError(
            f"{name}={raw!r} is not valid: expected 1 (show the compiler's output) or 0 "
            "(the default)"
        )
    return raw.strip() == "1"


def _node(name: str, raw: str) -> str:
    # What the value means (a node type, a file of facts) is fairring_pg.cuda.node_facts's,
    # which reads it when the job's facts are gathered.
    return raw.strip() or "detect"


def _setting(
    variable: str,
    parse: Callable[[str, str], Any],
    default: Any,
    *,
    job_wide: bool,
    help: str,
    shown: str | None = None,
    core: tuple[str, ...] = (),
    shapes_plan: bool = False,
    test_only: bool = False,
) -> Any:
    """One row of the settings table. ``parse(variable, raw)`` raises ValueError naming
    the variable; ``job_wide``: every rank must have the same value (compared at
    start-up); ``shown``: the default as the README shows it; ``core``: the fields of the
    core's options (``_C.Options``, dotted) that take the value as it is; ``shapes_plan``:
    a plan file saved under another value does not fit (fairring_pg.measured)."""
    metadata = {
        "variable": variable,
        "parse": parse,
        "job_wide": job_wide,
        "help": help,
        "shown": shown if shown is not None else f"`{default}`",
        "core": core,
        "shapes_plan": shapes_plan,
        "test_only": test_only,
    }
    return dataclasses.field(default=default, metadata=metadata)


_EQUAL = "; equal on all ranks"


@dataclass(frozen=True)
class Config:
    """The settings table: a row per variable (see ``_setting``)."""

    machine_id: str | None = _setting(
        "FAIRRING_MACHINE_ID",
        _non_empty,
        None,
        job_wide=False,
        shown="the hostname",
        help="machine identity: ranks with equal ids share a machine",
    )
    socket_ifname: str | None = _setting(
        "TP_SOCKET_IFNAME",
        _check_ifname,
        None,
        job_wide=False,
        shown="the interface that routes to `MASTER_ADDR`",
        help="interface fairring listens on for other machines",
    )
    slice_size: int = _setting(
        "FAIRRING_SLICE_SIZE",
        parse_byte_size,
        DEFAULT_SLICE_SIZE,
        job_wide=True,
        shapes_plan=True,
        shown="`25M` (DDP's bucket)",
        help="largest slice an allreduce is cut into" + _EQUAL,
    )
    total_memory: int = _setting(
        "FAIRRING_TOTAL_MEMORY",
        parse_byte_size,
        DEFAULT_TOTAL_MEMORY,
        job_wide=True,
        shapes_plan=True,
        shown="`50M`",
        core=("engine.total_memory", "subgroup.total_memory"),
        help="staging memory per process; bounds the slices in flight; must hold one slot" + _EQUAL,
    )
    slice_scaling: bool = _setting(
        "FAIRRING_SLICE_SCALING",
        _switch,
        True,
        job_wide=True,
        shapes_plan=True,
        shown="`on`",
        help="grow the slice with the number of machines so that shards stay ≥ 1 MiB (never "
        "beyond two slots in `FAIRRING_TOTAL_MEMORY`); `off` takes `FAIRRING_SLICE_SIZE` as "
        "given",
    )
    pipeline_chunk: int = _setting(
        "FAIRRING_PIPELINE_CHUNK",
        parse_byte_size,
        DEFAULT_PIPELINE_CHUNK,
        job_wide=True,
        shapes_plan=True,
        shown="`1M`",
        core=("engine.chunk_bytes",),
        help="CPU: each local rank's part of the piece of a slice that goes through the five "
        "steps on its own, so that the steps of consecutive pieces overlap; one machine never "
        "cuts slices",
    )
    rail_congestion: str = _setting(
        "FAIRRING_RAIL_CONGESTION",
        congestion.parse,
        "reno",
        job_wide=False,
        shapes_plan=True,
        core=("engine.rail_congestion",),
        help="CPU, 3 machines and more: the TCP congestion control of the sockets a rank "
        "sends to other machines on, one after another; `system` keeps the machine's "
        "(`net.ipv4.tcp_congestion_control`). Reno because BBR paces each of these flows at "
        "the share it last measured, leaving the link idle in between "
        "([bench/results/details.md](bench/results/details.md#rail-sockets-and-bbr))",
    )
    cpu_allreduce: str = _setting(
        "FAIRRING_CPU_ALLREDUCE",
        _choice(CPU_ALLREDUCE_PATHS),
        "auto",
        job_wide=True,
        shapes_plan=True,
        help="CPU: who runs allreduces. `auto`: fairring's engine where it is sure to win (one "
        "machine, or several ranks per machine saving more than the model's error: 2 × 2, "
        "2 × 3, 4 × 2 …), elsewhere (one rank per machine) each size class measured, the "
        "engine against Gloo's ring, and the faster kept "
        "([below](#the-measured-choice-what-auto-does)); `model`: the model's rule alone "
        "(with one rank per machine, Gloo's ring from 1 MiB); `engine`: always the engine; "
        "`gloo`: Gloo wherever it can reduce the dtype and op" + _EQUAL,
    )
    cuda_allreduce: str = _setting(
        "FAIRRING_CUDA_ALLREDUCE",
        _choice(CUDA_ALLREDUCE_PATHS),
        "auto",
        job_wide=True,
        shapes_plan=True,
        help="CUDA: `auto` measures, at each call size where the cost model predicts "
        "composing of NCCL sub-group collectives to win or to be within its error for this "
        "cluster's machines (`FAIRRING_NODE`), NCCL's own allreduce against that composition "
        "and keeps the faster; elsewhere (unknown machines, one rank per machine, one "
        "machine, smaller than `FAIRRING_DIRECT_BELOW`) it runs NCCL's own; `model` composes "
        "where the model predicts NCCL's own at least 1.10× slower, without measuring; "
        "`lanes` composes wherever there are several machines; `direct` always runs NCCL's "
        "own" + _EQUAL,
    )
    plan_file: str | None = _setting(
        "FAIRRING_PLAN_FILE",
        _check_plan_file,
        None,
        job_wide=True,
        shown="unset",
        help="a JSON file that keeps the measured choice's decisions: made by the first job, "
        "read by later jobs of the same shape, which then skip the trials; a file made by a "
        "job of another shape is an error at `init_process_group`" + _EQUAL,
    )
    node: str = _setting(
        "FAIRRING_NODE",
        _node,
        "detect",
        job_wide=False,
        help="CUDA: what the machines are made of, for `auto`'s plan: `detect` (GPU "
        "generation, NVLink, NICs and their rates from sysfs, the CPU's vendor from "
        "`/proc/cpuinfo`), a node type of `fairring-plan --node` (`h100-8x400g`, "
        "`h100-2x200g`, `a100-4x200g`, `v100-4x100g`), a JSON file of facts (`arch`, "
        "`nvlink`, `nics` or `nic` and `nics_per_machine`, optionally `intra`, `nvls`, "
        "`cpu`: `intel`, `amd` or `other`), or `none`; machines whose facts differ make them "
        "unknown (NCCL's allreduce)",
    )
    lanes: int = _setting(
        "FAIRRING_LANES",
        _count(1, MAX_LANES),
        DEFAULT_LANES,
        job_wide=True,
        shapes_plan=True,
        help="CUDA, where allreduces are composed: rail communicators per rank, i.e. pieces "
        "on the wire at once (1–16); from a sweep on an H100",
    )
    direct_below: int = _setting(
        "FAIRRING_DIRECT_BELOW",
        _size_or_zero,
        DEFAULT_DIRECT_BELOW,
        job_wide=True,
        shapes_plan=True,
        shown="`2M`",
        help="CUDA, where allreduces are composed: smaller ones are one NCCL allreduce (`0`: "
        "never); from the same runs",
    )
    # NCCL on one rank and Gloo on another would hang both.
    cuda_delegate: str = _setting(
        "FAIRRING_CUDA_DELEGATE",
        _choice(CUDA_DELEGATES),
        "auto",
        job_wide=True,
        shapes_plan=True,
        help="who runs the other collectives on CUDA tensors: `nccl`, `gloo`, or `auto` "
        "(NCCL unless ranks share a GPU)",
    )
    timeline: str | None = _setting(
        "FAIRRING_TIMELINE",
        _check_timeline,
        None,
        job_wide=False,
        shown="off",
        help="write a Chrome trace per rank to this path (`t.json` → `t.rank3.json`, or "
        "`{rank}` in the path); merge with `fairring-timeline merged.json t.rank*.json`",
    )
    build_dir: str | None = _setting(
        "FAIRRING_BUILD_DIR",
        _non_empty,
        None,
        job_wide=False,
        shown="`~/.cache/fairring_pg/<hash>`",
        help="where the core is compiled and cached; a path each machine can lock",
    )
    build_verbose: bool = _setting(
        "FAIRRING_BUILD_VERBOSE",
        _verbose,
        False,
        job_wide=False,
        shown="`0`",
        help="`1` shows the compiler's output",
    )
    # CPU tensors take the sub-group path over Gloo groups, so that CI runs the CUDA
    # path's orchestration.
    test_cpu_subgroups: bool = _setting(
        "FAIRRING_TEST_CPU_SUBGROUPS",
        _switch,
        False,
        job_wide=True,
        shapes_plan=True,
        test_only=True,
        help="CPU tensors take the sub-group path, over Gloo groups",
    )
    # Several ranks of a simulated machine on one GPU, which NCCL refuses.
    test_local_gloo: bool = _setting(
        "FAIRRING_TEST_LOCAL_GLOO",
        _switch,
        False,
        job_wide=True,
        shapes_plan=True,
        test_only=True,
        help="CUDA's local groups are Gloo's",
    )
    # The plan given, so that tests force pieces and both rail exchanges; its rows are
    # fairring_pg.model.cuda_plan.forced_rows's to read.
    test_cuda_plan: str | None = _setting(
        "FAIRRING_TEST_CUDA_PLAN",
        _non_empty,
        None,
        job_wide=True,
        test_only=True,
        help="the CUDA allreduce's plan, given",
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Config:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["variable"])
            if raw is not None:
                values[f.name] = f.metadata["parse"](f.metadata["variable"], raw)
        return cls(**values)

    @classmethod
    def read(cls, name: str, environ: Mapping[str, str] = os.environ) -> Any:
        """One setting (by field name) from the environment, the others not read: for the
        build, which runs before a job's settings exist."""
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        raw = environ.get(f.metadata["variable"])
        return f.default if raw is None else f.metadata["parse"](f.metadata["variable"], raw)

    def core_values(self) -> list[tuple[str, Any]]:
        """(dotted field of the core's options, value) for each row the core takes as is."""
        return [
            (target, getattr(self, f.name))
            for f in dataclasses.fields(self)
            for target in f.metadata["core"]
        ]

    def plan_shaping(self) -> dict[str, Any]:
        """The settings a saved plan file depends on, by field name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata["shapes_plan"]
        }

    def effective_slice_size(self, num_machines: int, local_size: int) -> int:
        """The CPU engine's slice (fairring_pg.sizing.scaled_slice_bytes)."""
        return sizing.scaled_slice_bytes(
            self.slice_size, self.slice_scaling, self.total_memory, num_machines, local_size
        )

    def cpu_ring_from(self, num_machines: int, local_size: int) -> int:
        """Where the model's rule gives a CPU allreduce to Gloo's ring
        (fairring_pg.sizing.cpu_ring_from)."""
        return sizing.cpu_ring_from(self.cpu_allreduce, num_machines, local_size)

    def subgroup_slice_size(self, num_machines: int, local_size: int) -> int:
        """The sub-group path's largest piece (fairring_pg.sizing.largest_piece_bytes)."""
        return sizing.largest_piece_bytes(
            self.slice_size,
            self.slice_scaling,
            self.lanes,
            self.total_memory,
            num_machines,
            local_size,
        )

    def timeline_path(self, rank: int, group_name: str = "0") -> str:
        """This rank's trace file: '{rank}' in FAIRRING_TIMELINE is replaced, else the
        rank goes before the extension (trace.json -> trace.rank3.json); a group other
        than the default one writes its own (trace.rank3.g2.json: file_for_group)."""
        if self.timeline is None:
            return ""
        if "{rank}" in self.timeline:
            path = self.timeline.replace("{rank}", str(rank))
        else:
            root, ext = os.path.splitext(self.timeline)
            path = f"{root}.rank{rank}{ext or '.json'}"
        return file_for_group(path, group_name)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def check_staging_fits(self, num_machines: int, local_size: int) -> None:
        """Fail if ``total_memory`` cannot hold a single staging slot."""
        need = sizing.staging_slot_bytes(self.slice_size, num_machines, local_size)
        if self.total_memory < need:
            raise ValueError(
                f"FAIRRING_TOTAL_MEMORY={self.total_memory} cannot hold one staging slot for "
                f"FAIRRING_SLICE_SIZE={self.slice_size} with {num_machines} machine(s) of "
                f"{local_size} rank(s): expected FAIRRING_TOTAL_MEMORY >= {need}, or a smaller "
                "FAIRRING_SLICE_SIZE"
            )

    def check_staging_allocatable(self) -> None:
        """Fail if ``total_memory`` is more than this machine's memory: the core would
        fail to allocate it only once groups are built, a rank at a time, and a peer
        still connecting would see a closed connection, not the variable at fault."""
        try:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return
        if 0 < physical < self.total_memory:
            raise ValueError(
                f"FAIRRING_TOTAL_MEMORY={self.total_memory} is more than this machine's "
                f"memory ({physical} bytes); set a smaller FAIRRING_TOTAL_MEMORY"
            )

    def check_consistent_across_ranks(
        self, store: Any, rank: int, world_size: int, timeout: timedelta | None = None
    ) -> None:
        """Fail on every rank whose job-wide settings differ from rank 0's.

        Each rank publishes its settings; ranks > 0 compare with rank 0, and rank 0
        compares with everyone, so a mismatch is reported on rank 0 too instead of
        leaving it to time out later waiting for a rank that gave up.
        """
        store.set(_STORE_KEY.format(rank=rank), self.to_json())
        others = [0] if rank != 0 else list(range(1, world_size))
        if not others:
            return
        keys = [_STORE_KEY.format(rank=r) for r in others]
        if timeout is not None:
            from fairring_pg.startup import wait_for

            wait_for(store, keys, timeout, "waiting to compare FAIRRING_* settings", others)
        mine = dataclasses.asdict(self)
        job_wide = [f for f in dataclasses.fields(self) if f.metadata["job_wide"]]
        for other, key in zip(others, keys, strict=True):
            theirs = json.loads(store.get(key))
            for f in job_wide:
                if mine[f.name] != theirs.get(f.name):
                    raise ValueError(
                        f"{f.metadata['variable']} differs across ranks: rank {rank} has "
                        f"{_show(f, mine[f.name])}, rank {other} has "
                        f"{_show(f, theirs.get(f.name))}; expected the same value on "
                        "every rank"
                    )


def _show(f: dataclasses.Field[Any], value: Any) -> str:
    if f.metadata["parse"] is _switch:
        return "'on'" if value else "'off'"
    return repr(value)


def settings_markdown() -> str:
    """The README's table of settings, made from ``Config``'s rows (the test-only
    switches left out)."""
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(Config):
        m = f.metadata
        if not m["test_only"]:
            lines.append(f"| `{m['variable']}` | {m['shown']} | {m['help']} |")
    return "\n".join(lines)


def testing_variables() -> list[str]:
    return [f.metadata["variable"] for f in dataclasses.fields(Config) if f.metadata["test_only"]]
