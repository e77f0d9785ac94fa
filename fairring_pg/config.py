"""The user's knobs: every ``FAIRRING_*`` variable (and ``TP_SOCKET_IFNAME``), read once.

Each bad value is a ``ValueError`` naming the variable, the value and what is accepted,
raised at ``init_process_group`` rather than somewhere deep in the data path.
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

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB

DEFAULT_SLICE_SIZE = 25 * MIB  # DDP's default bucket, so one bucket is one slice
DEFAULT_TOTAL_MEMORY = 50 * MIB
# Smallest shard slice scaling aims for: below about this, fixed per-message costs
# (headers, wake-ups, a loop iteration per peer) outweigh the bytes moved.
MIN_SHARD_BYTES = 1 * MIB
# The piece of a slice that the CPU pipeline moves through its five steps, so that the
# reduce and diffuse of one piece overlap the collect of the next. Measured on 4x1 at
# 1 Gbit/s (bench/results/HISTORY.md).
DEFAULT_PIPELINE_CHUNK = 1 * MIB
# Who runs the collectives other than allreduce on CUDA tensors (see fairring_pg/cuda.py).
CUDA_DELEGATES = ("auto", "nccl", "gloo")
# The sub-group allreduce (CUDA): rail communicators, so that this many slices are on
# the wire at once. Chosen from a sweep of 1, 2, 4, 8 at 4x1 on an H100 (bench/results/
# cuda/): 2 was fastest at 100 MiB, with 16 x 25 MiB in flight and in DDP, and its
# communicators took the least GPU memory; 4 only won at 25 MiB.
DEFAULT_LANES = 2
MAX_LANES = 16
# Below this many bytes a CUDA allreduce is one NCCL allreduce: latency-bound, where
# one launch beats five. On an H100 the five steps took 1.08-1.48x NCCL's time at
# 1 MiB in every run, and won at 25 MiB (bench/results/cuda/).
DEFAULT_DIRECT_BELOW = 2 * MIB
# Who runs an allreduce of CPU tensors (fairring_pg.model.cpu_plan). "auto": fairring's
# engine where the model is sure of it (one machine; several ranks per machine where the
# engine's saving exceeds the model's error), else each size class timed both ways on its
# first calls, the engine and Gloo's ring, every rank then running the faster (the
# measured choice, src/measured/). "model": the model's verdict alone: the engine, but
# with one rank per machine, where its five steps send as many bytes as Gloo's ring,
# allreduces from CPU_RING_FROM go to the ring, which fills a link with one flow per host
# where the engine's all-to-all has several (at 4x1 on 1 Gbit/s links the engine took
# 0.94-0.99x Gloo's speed from 1 MiB up and 1.2-7.9x below it,
# bench/results/allreduce_sizes_netns_1gbit.md). "engine": always fairring's engine;
# "gloo": always Gloo's allreduce (for comparison).
CPU_ALLREDUCE_PATHS = ("auto", "model", "engine", "gloo")
CPU_RING_FROM = 1 * MIB

# Which path the sub-group (CUDA) allreduce takes (fairring_pg.model.cuda_plan). "model":
# the cost model's plan: the composition only where it predicts a win larger than its
# error, with several ranks per machine (with one they send as many bytes per rank as the
# ring, 2(M-1)/M of the tensor, and on an H100 at 4x1 they lost in flight, 1.26x NCCL's
# time, and in DDP, 0.91x), else NCCL's own allreduce on the world communicator. "auto":
# the same candidates, but every size the model would compose or calls within its error
# timed both ways on its first calls, every rank then running the faster (the measured
# choice). "lanes": the composition wherever there are several machines (to measure it);
# "direct": NCCL's allreduce always.
CUDA_ALLREDUCE_PATHS = ("auto", "model", "lanes", "direct")
MAX_BYTES = TIB  # anything larger is a typo, not a configuration

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


def _check_forced_plan(name: str, raw: str) -> str:
    from fairring_pg.model.cuda_plan import forced_rows

    forced_rows(raw)  # raises naming the variable
    return raw.strip()


def _setting(
    variable: str, parse: Callable[[str, str], Any], default: Any, *, job_wide: bool
) -> Any:
    """One row of the settings table: the variable, its parser (raises ValueError
    naming the variable), its default, and whether every rank must agree on it."""
    return dataclasses.field(
        default=default, metadata={"variable": variable, "parse": parse, "job_wide": job_wide}
    )


@dataclass(frozen=True)
class Config:
    """Every setting, one line each: the field, its variable, parser, default and
    whether it is job-wide (compared across ranks at start-up). The machine id and the
    interface name legitimately differ between machines; the timeline is per rank."""

    slice_size: int = _setting(
        "FAIRRING_SLICE_SIZE", parse_byte_size, DEFAULT_SLICE_SIZE, job_wide=True
    )
    total_memory: int = _setting(
        "FAIRRING_TOTAL_MEMORY", parse_byte_size, DEFAULT_TOTAL_MEMORY, job_wide=True
    )
    machine_id: str | None = _setting("FAIRRING_MACHINE_ID", _non_empty, None, job_wide=False)
    socket_ifname: str | None = _setting("TP_SOCKET_IFNAME", _check_ifname, None, job_wide=False)
    slice_scaling: bool = _setting("FAIRRING_SLICE_SCALING", _switch, True, job_wide=True)
    timeline: str | None = _setting("FAIRRING_TIMELINE", _check_timeline, None, job_wide=False)
    # Who runs CUDA collectives: NCCL on one rank and Gloo on another hang both.
    cuda_delegate: str = _setting(
        "FAIRRING_CUDA_DELEGATE", _choice(CUDA_DELEGATES), "auto", job_wide=True
    )
    lanes: int = _setting("FAIRRING_LANES", _count(1, MAX_LANES), DEFAULT_LANES, job_wide=True)
    direct_below: int = _setting(
        "FAIRRING_DIRECT_BELOW", _size_or_zero, DEFAULT_DIRECT_BELOW, job_wide=True
    )
    cpu_allreduce: str = _setting(
        "FAIRRING_CPU_ALLREDUCE", _choice(CPU_ALLREDUCE_PATHS), "auto", job_wide=True
    )
    cuda_allreduce: str = _setting(
        "FAIRRING_CUDA_ALLREDUCE", _choice(CUDA_ALLREDUCE_PATHS), "auto", job_wide=True
    )
    # The measured choice's decisions, saved by the job that made them and reused by a
    # later job of the same shape (fairring_pg.measured); rank 0 reads and writes it.
    plan_file: str | None = _setting("FAIRRING_PLAN_FILE", _check_plan_file, None, job_wide=True)
    pipeline_chunk: int = _setting(
        "FAIRRING_PIPELINE_CHUNK", parse_byte_size, DEFAULT_PIPELINE_CHUNK, job_wide=True
    )
    # Test switches: CPU tensors take the sub-group path over Gloo groups (so CI runs
    # the CUDA path's orchestration); CUDA's local groups are Gloo (several ranks of a
    # simulated machine on one GPU, which NCCL refuses).
    test_cpu_subgroups: bool = _setting(
        "FAIRRING_TEST_CPU_SUBGROUPS", _switch, False, job_wide=True
    )
    test_local_gloo: bool = _setting("FAIRRING_TEST_LOCAL_GLOO", _switch, False, job_wide=True)
    # Test switch: the CUDA allreduce's plan given instead of computed, so that the
    # tests force pieces and both rail exchanges (fairring_pg.model.cuda_plan.forced).
    test_cuda_plan: str | None = _setting(
        "FAIRRING_TEST_CUDA_PLAN", _check_forced_plan, None, job_wide=True
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Config:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["variable"])
            if raw is not None:
                values[f.name] = f.metadata["parse"](f.metadata["variable"], raw)
        return cls(**values)

    def effective_slice_size(self, num_machines: int, local_size: int) -> int:
        """The slice actually used: FAIRRING_SLICE_SIZE, grown against over-sharding.

        A slice is cut into L*M shards; at many machines they get so small that per-message
        costs dominate (Fairring's "over-sharding"). With scaling on, the slice grows until
        every shard has at least MIN_SHARD_BYTES, but never so far that fewer than two
        slices fit in the staging memory (that would serialise the pipeline).
        """
        base = self.slice_size
        if not self.slice_scaling:
            return base
        wanted = max(base, MIN_SHARD_BYTES * num_machines * local_size)
        while (
            wanted > base
            and 2 * staging_slot_bytes(wanted, num_machines, local_size) > self.total_memory
        ):
            wanted = max(base, wanted // 2)
        return wanted

    def cpu_ring_from(self, num_machines: int, local_size: int) -> int:
        """Bytes from which the model's rule (FAIRRING_CPU_ALLREDUCE=model, and what the
        cost model predicts for auto) gives a CPU allreduce to Gloo's ring instead of
        fairring's engine, or -1 for never. The same on every rank: the variable is
        job-wide and the shape is the job's."""
        if self.cpu_allreduce == "gloo":
            return 0
        if self.cpu_allreduce == "engine" or local_size > 1 or num_machines == 1:
            return -1
        return CPU_RING_FROM

    def slices_allreduces(self, num_machines: int, local_size: int) -> bool:
        """Whether FAIRRING_CUDA_ALLREDUCE lets the sub-group (CUDA) path compose
        allreduces at all (its plan then says for which sizes:
        fairring_pg.model.cuda_plan), or gives every one to one allreduce on the world
        group. The same on every rank: the variable is job-wide and the shape is the
        job's."""
        if num_machines == 1 or self.cuda_allreduce == "direct":
            return False
        return self.cuda_allreduce == "lanes" or local_size > 1

    def subgroup_slice_size(self, num_machines: int, local_size: int) -> int:
        """The largest piece of the sub-group (CUDA) path.

        FAIRRING_SLICE_SIZE, grown against over-sharding as for the CPU path, then cut to
        the largest size that lets each of the FAIRRING_LANES lanes hold its staging
        within FAIRRING_TOTAL_MEMORY, and rounded down to a multiple of 16*L*M bytes so that
        a piece of any dtype splits evenly into L chunks of M shards, each starting 16 bytes
        apart (src/subgroups/call_plan.h).
        """
        unit = 16 * num_machines * local_size
        wanted = self.slice_size
        if self.slice_scaling:
            wanted = max(wanted, MIN_SHARD_BYTES * num_machines * local_size)
        wanted = max(unit, wanted // unit * unit)
        if not self.slices_allreduces(num_machines, local_size):
            return wanted  # one NCCL allreduce per tensor: no slices, no staging

        def fits(size: int) -> bool:
            need = self.lanes * lane_staging_bytes(size, num_machines, local_size)
            return need <= self.total_memory

        if not fits(unit):
            need = self.lanes * lane_staging_bytes(unit, num_machines, local_size)
            raise ValueError(
                f"FAIRRING_TOTAL_MEMORY={self.total_memory} cannot hold a staging slot for "
                f"each of FAIRRING_LANES={self.lanes} lanes with {num_machines} machine(s) of "
                f"{local_size} rank(s), even for the smallest slice ({unit} bytes): expected "
                f"FAIRRING_TOTAL_MEMORY >= {need}, or fewer lanes"
            )
        lo, hi = 1, wanted // unit  # in units; fits(lo * unit) holds
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid * unit) else (lo, mid - 1)
        return lo * unit

    def timeline_path(self, rank: int) -> str:
        """This rank's trace file: '{rank}' in FAIRRING_TIMELINE is replaced, else the
        rank goes before the extension (trace.json -> trace.rank3.json)."""
        if self.timeline is None:
            return ""
        if "{rank}" in self.timeline:
            return self.timeline.replace("{rank}", str(rank))
        root, ext = os.path.splitext(self.timeline)
        return f"{root}.rank{rank}{ext or '.json'}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def check_staging_fits(self, num_machines: int, local_size: int) -> None:
        """Fail if ``total_memory`` cannot hold a single staging slot."""
        need = staging_slot_bytes(self.slice_size, num_machines, local_size)
        if self.total_memory < need:
            raise ValueError(
                f"FAIRRING_TOTAL_MEMORY={self.total_memory} cannot hold one staging slot for "
                f"FAIRRING_SLICE_SIZE={self.slice_size} with {num_machines} machine(s) of "
                f"{local_size} rank(s): expected FAIRRING_TOTAL_MEMORY >= {need}, or a smaller "
                "FAIRRING_SLICE_SIZE"
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

            wait_for(store, keys, timeout, "waiting to compare FAIRRING_* settings")
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


def staging_slot_bytes(slice_size: int, num_machines: int, local_size: int) -> int:
    """Bytes of staging memory one slice in flight needs on one rank.

    The intra-node part receives a chunk from each of the L-1 peers, the rail part a
    shard from each of the M-1 other machines; each message carries a small header
    (8 and 16 bytes) and the slot is cache-line aligned.
    """
    if slice_size < 0 or num_machines < 1 or local_size < 1:
        raise ValueError(
            f"staging_slot_bytes({slice_size}, {num_machines}, {local_size}): "
            "expected slice_size >= 0, num_machines >= 1, local_size >= 1"
        )
    s, m, loc = slice_size, num_machines, local_size
    chunk = Fraction(s, loc) + 8
    shard = Fraction(s, loc * m) + 16
    total = (loc - 1) * _ceil(chunk) + (m - 1) * _ceil(shard)
    return -(-total // 64) * 64


def _ceil(x: Fraction) -> int:
    return -(-x.numerator // x.denominator)


def lane_staging_bytes(piece_size: int, num_machines: int, local_size: int) -> int:
    """Bytes of staging one lane of the sub-group (CUDA) path holds for pieces of up to
    ``piece_size`` bytes: the all-to-all exchange's M copies of my shard (a chunk) and my
    reduced shard, each region 256-byte aligned; the local steps and the reduce-scatter
    exchange work in place. The one definition: the core is handed the result."""
    chunk = piece_size // local_size
    shard = chunk // num_machines

    def aligned(n: int) -> int:
        return -(-n // 256) * 256

    return aligned(chunk) + aligned(shard)
