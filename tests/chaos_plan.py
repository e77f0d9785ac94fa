"""The chaos run's jobs (scripts/chaos.py), drawn from a seed: a simulated cluster, a
program of mixed collectives that every rank issues alike, and at most one fault.

Pure: no torch, no process. The same seed gives the same job on every rank and in
every run, so a failing seed replays (``python scripts/chaos.py --seed S --jobs 1``).
"""

from __future__ import annotations

import dataclasses
import math
import random

SHAPES = ("2x2", "3x1", "2x3")
FLOATS = ("float32", "float64", "float16", "bfloat16")
INTS = ("int8", "int16", "int32", "int64", "uint8")
DTYPES = FLOATS + INTS + ("bool",)
OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
# Call kinds, with how often a program draws each.
KINDS = {
    "allreduce": 5,
    "reduce_scatter": 2,
    "all_gather": 2,
    "barrier": 1,
    "broadcast": 1,
    "ddp": 1,
}
# The engine's forms (tests/collective_forms.py) of the sharded kinds.
SHARDED_FORMS = {
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_list", "reduce_scatter_coalesced"),
    "all_gather": ("all_gather", "all_gather_list", "all_gather_coalesced"),
}
DDP_HOOKS = ("none", "fp16", "chained")
ALLREDUCE_FORMS = ("", "", "coalesced", "strided")  # "": the tensor as it is
# Fault kinds and how often each is drawn: a rank killed (SIGKILL), leaving otherwise
# (a launcher's SIGTERM, handled or not, or its program ending early), killed while its
# group starts, a connection cut, a rank frozen, a delay at a fault point, a rank slow
# for most of the timeout (which must not fail), a bad call, a call one rank skips.
FAULTS = {
    "none": 1,
    "kill": 2,
    "leave": 1,
    "start_kill": 1,
    "cut": 2,
    "freeze": 1,
    "delay": 2,
    "slow": 1,
    "bad_call": 2,
    "skip": 1,
}
# Drawn besides: in half the jobs FAULTS gives none, the store's host dies at a call; in
# half the delays at mesh.read.close, two ranks are cut off from each other for a while.
FAULT_KINDS = (*FAULTS, "store_death", "partition")
# How a leaving rank goes, and the exit status its launcher sees.
LEAVES = ("sigterm", "sigterm_handled", "exit")
# Points a delay can sit at (src/faults/fault_points.h), each firing in a program
# without a failure. mesh.send.first holds an abort, so it fires only where a rank
# fails: a bad call draws it (an abort held while the others wait for the reason).
DELAY_POINTS = ("mesh.connect", "engine.start", "engine.reduce", "mesh.read.close")
# How one rank gets a call wrong, by kind.
BAD_CALLS = {
    "allreduce": ("size", "empty", "dtype", "op"),
    "reduce_scatter": ("refused", "size"),
    "all_gather": ("refused", "size"),
}
# One rank per machine hands allreduces of 1 MiB and more to Gloo's ring
# (FAIRRING_CPU_ALLREDUCE=auto): 3x1 programs draw some that large.
RING_NUMEL = 1 << 18
MAX_NUMEL = 1 << 14
# A kill in the middle of a large transfer: the turn's call made 16 MiB, killed up to
# BIG_AFTER_MS after every rank posted it.
BIG_NUMEL = 1 << 22
BIG_AFTER_MS = 150
MATE_AFTER_S = 0.15  # torchrun's agent ends the rest of a machine whose rank died
GROUP_TIMEOUT_S = 30.0  # a fault that is not a freeze must never need the timeout
FREEZE_TIMEOUT_S = 3.0  # a freeze, a kill at start-up, a skipped call: the timeout ends it
SLOW_TIMEOUT_S = 5.0
SLOW_FRACTION = 0.7  # a slow rank posts its call this far into the group's timeout
PARTITION_FRACTION = 0.5  # a partition heals this far into the group's timeout
START_KILL_MS = 400  # a kill at start-up falls this long after the group's creation began


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of the program, the same on every rank (but for a bad call's rank)."""

    index: int
    kind: str
    numel: int = 0  # per rank for the sharded kinds
    dtype: str = "float32"
    op: str = "SUM"
    form: str = ""  # allreduce, sharded kinds: the form; ddp: the hook
    src: int = 0  # broadcast's root

    def describe(self) -> str:
        if self.kind == "allreduce":
            form = f" ({self.form})" if self.form else ""
            return f"#{self.index} allreduce{form} {self.numel} {self.dtype} {self.op}"
        if self.kind in SHARDED_FORMS:
            return f"#{self.index} {self.form} {self.numel}/rank"
        if self.kind == "broadcast":
            return f"#{self.index} broadcast {self.numel} from {self.src}"
        if self.kind == "ddp":
            return f"#{self.index} ddp step ({self.form} hook)"
        return f"#{self.index} {self.kind}"


@dataclasses.dataclass(frozen=True)
class Fault:
    """At most one per job, at call ``turn`` on ``rank``."""

    kind: str = "none"
    rank: int = -1
    turn: int = -1
    point: str = ""  # delay, cut: the fault point
    peer: int = -1  # its key (a peer), -1: any
    delay_ms: int = 0
    times: int = 1
    variant: str = ""  # bad_call: how the call is wrong
    after_ms: int = 0  # kill: from posting its call to dying
    mates_die: bool = False  # kill: its machine-mates die MATE_AFTER_S later
    held_abort_ms: int = 0  # bad_call: another rank holds its aborts this long
    how: str = ""  # leave: one of LEAVES

    def describe(self) -> str:
        if self.kind == "none":
            return "no fault"
        at = f"rank {self.rank} at call {self.turn}"
        if self.kind == "kill":
            return f"kill {at}" + (" and its machine-mates" if self.mates_die else "")
        if self.kind == "cut":
            return f"cut {at}: {self.point} from rank {self.peer}"
        if self.kind == "delay":
            key = "" if self.peer < 0 else f" key {self.peer}"
            return f"delay {at}: {self.point}{key} {self.delay_ms} ms x{self.times}"
        if self.kind == "leave":
            return f"{self.how} of {at}"
        if self.kind == "start_kill":
            return f"kill of rank {self.rank} {self.after_ms} ms into the group's creation"
        if self.kind == "partition":
            ends = f"ranks {self.rank} and {self.peer}"
            return f"partition of {ends} at call {self.turn}, healed after {self.delay_ms} ms"
        if self.kind == "store_death":
            return f"the store's host killed by rank {self.rank} at call {self.turn}"
        if self.kind == "slow":
            return f"{at} {self.delay_ms} ms late"
        if self.kind == "bad_call":
            held = f", aborts held {self.held_abort_ms} ms" if self.held_abort_ms else ""
            return f"bad call ({self.variant}) {at}{held}"
        return f"{self.kind} {at}"


@dataclasses.dataclass(frozen=True)
class Job:
    seed: int
    shape: str
    machines: tuple[str, ...]
    calls: tuple[Call, ...]
    fault: Fault
    env: tuple[tuple[str, str], ...]
    group_timeout_s: float
    # The same program on a Gloo group beside fairring's, for its time to raise.
    mirror_gloo: bool

    @property
    def world(self) -> int:
        return len(self.machines)

    def mates(self, rank: int) -> list[int]:
        return [r for r, m in enumerate(self.machines) if m == self.machines[rank] and r != rank]

    def dead(self) -> set[int]:
        """The ranks the fault ends: killed (with their machine-mates), leaving, frozen."""
        fault = self.fault
        if fault.kind not in ("kill", "leave", "start_kill", "freeze"):
            return set()
        if fault.kind == "kill" and fault.mates_die:
            return {fault.rank, *self.mates(fault.rank)}
        return {fault.rank}

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env)
        calls = f"{len(self.calls)} calls"
        return f"seed {self.seed}: {self.shape}, {calls}, {self.fault.describe()} ({env})"


def machines_of(shape: str) -> tuple[str, ...]:
    m, local = (int(x) for x in shape.split("x"))
    return tuple(f"m{i}" for i in range(m) for _ in range(local))


def _weighted(rng: random.Random, table: dict[str, int]) -> str:
    return rng.choices(list(table), weights=list(table.values()))[0]


def _numel(rng: random.Random, top: int) -> int:
    if rng.random() < 0.05:
        return 0
    return int(math.exp(rng.uniform(0, math.log(top))))


def _call(rng: random.Random, index: int, shape: str, world: int, hook: str) -> Call:
    kind = _weighted(rng, KINDS)
    if kind == "allreduce":
        dtype = rng.choice(DTYPES)
        op = rng.choice(OPS)
        if op == "AVG" and dtype not in FLOATS:
            op = "SUM"  # AVG on integers is refused (a bad call of every rank: not drawn)
        ring = shape == "3x1" and rng.random() < 0.15
        numel = RING_NUMEL + rng.randrange(2) if ring else _numel(rng, MAX_NUMEL)
        if ring and dtype in ("float16", "bfloat16", "int8", "uint8", "bool", "int16"):
            dtype = "float32"  # 1 MiB needs 4-byte elements at this count
        return Call(index, kind, numel, dtype, op)
    if kind in SHARDED_FORMS:
        return Call(
            index,
            kind,
            _numel(rng, MAX_NUMEL // world),
            "int64",
            form=rng.choice(SHARDED_FORMS[kind]),
        )
    if kind == "broadcast":
        return Call(index, kind, _numel(rng, MAX_NUMEL), "float32", src=rng.randrange(world))
    if kind == "ddp":
        return Call(index, kind, form=hook)
    return Call(index, kind)


def _allreduce_form(seed: int, call: Call) -> Call:
    """An allreduce's form, from a stream of its own (the rest of the draw stays as it
    was): the tensor, two tensors coalesced, or a strided view (every other element)."""
    if call.kind != "allreduce" or call.numel >= RING_NUMEL:
        return call
    form = random.Random(f"chaos/{seed}/form/{call.index}").choice(ALLREDUCE_FORMS)
    if form == "coalesced" and call.numel < 2:
        return call
    return dataclasses.replace(call, form=form)


def _env(rng: random.Random) -> tuple[tuple[str, str], ...]:
    slice_size = rng.choice((16 * 1024, 64 * 1024, 256 * 1024))
    return (
        ("FAIRRING_SLICE_SIZE", str(slice_size)),
        ("FAIRRING_TOTAL_MEMORY", str(max(1 << 20, 4 * slice_size))),
        ("FAIRRING_PIPELINE_CHUNK", rng.choice(("4K", "16K", "1M"))),
        ("FAIRRING_CPU_ALLREDUCE", rng.choice(("auto", "auto", "engine"))),
    )


def _peers_it_reads(machines: tuple[str, ...], rank: int) -> list[int]:
    """Whom ``rank`` reads bodies from: its machine-mates and its rail."""
    local = [r for r, m in enumerate(machines) if m == machines[rank]]
    lr = local.index(rank)
    rail = [
        r
        for r, m in enumerate(machines)
        if m != machines[rank] and [q for q, n in enumerate(machines) if n == m].index(r) == lr
    ]
    return [r for r in local if r != rank] + rail


def _fault(rng: random.Random, calls: list[Call], machines: tuple[str, ...]) -> Fault:
    kind = _weighted(rng, FAULTS)
    world = len(machines)
    rank = rng.randrange(world)
    # Leave calls after the fault's turn, so that it meets work in flight and later calls.
    turn = rng.randrange(max(1, len(calls) - 2))
    if kind == "kill":
        multi = len(set(machines)) < world
        return Fault(
            kind, rank, turn, after_ms=rng.randrange(0, 20), mates_die=multi and rng.random() < 0.5
        )
    if kind in ("freeze", "skip"):
        return Fault(kind, rank, turn)
    if kind == "leave":
        return Fault(kind, rank, turn, after_ms=rng.randrange(0, 20), how=rng.choice(LEAVES))
    if kind == "start_kill":
        return Fault(kind, rank, -1, after_ms=rng.randrange(0, START_KILL_MS))
    if kind == "slow":
        late_ms = int(SLOW_FRACTION * SLOW_TIMEOUT_S * 1000)
        return Fault(kind, rank, turn, delay_ms=late_ms)
    if kind == "cut":
        peer = rng.choice(_peers_it_reads(machines, rank))
        return Fault(kind, rank, turn, point="mesh.read.close", peer=peer)
    if kind == "delay":
        point = rng.choice(DELAY_POINTS)
        peer = rng.choice(_peers_it_reads(machines, rank)) if point.startswith("mesh.") else -1
        start_up = point in ("mesh.connect", "engine.start")
        return Fault(
            kind,
            rank,
            -1 if start_up else turn,
            point=point,
            peer=peer,
            delay_ms=rng.choice((20, 100, 400)),
            times=rng.randint(1, 3),
        )
    if kind == "bad_call":
        eligible = [c for c in calls if c.kind in BAD_CALLS and c.index < len(calls) - 1]
        if not eligible:
            return Fault()
        call = rng.choice(eligible)
        held = rng.choice((0, 0, 300)) if world > 2 else 0
        return Fault(
            kind, rank, call.index, variant=rng.choice(BAD_CALLS[call.kind]), held_abort_ms=held
        )
    return Fault()


def draw_job(seed: int) -> Job:
    rng = random.Random(f"chaos/{seed}")
    shape = rng.choice(SHAPES)
    machines = machines_of(shape)
    world = len(machines)
    hook = rng.choice(DDP_HOOKS)
    calls = [_call(rng, i, shape, world, hook) for i in range(rng.randint(5, 10))]
    calls = [_allreduce_form(seed, c) for c in calls]
    fault = _fault(rng, calls, machines)
    if fault.kind == "none" and random.Random(f"chaos/{seed}/store").random() < 0.5:
        # The store's host dies at a call: drawn from a stream of its own, in half the
        # jobs that have no other fault, so that every other job stays as it was drawn.
        store = random.Random(f"chaos/{seed}/store")
        fault = Fault("store_death", store.randrange(len(machines)), store.randrange(len(calls)))
    if fault.point == "mesh.read.close" and fault.kind == "delay":
        # Half of these become a partition between the two ranks that heals at half the
        # timeout (iptables and nft are absent here: each end's reader stops instead).
        if random.Random(f"chaos/{seed}/partition").random() < 0.5:
            heal_ms = int(PARTITION_FRACTION * SLOW_TIMEOUT_S * 1000)
            fault = dataclasses.replace(fault, kind="partition", delay_ms=heal_ms, times=1)
    if fault.kind == "kill" and rng.random() < 0.3:
        # A large transfer killed midway (on Gloo's ring where the job hands it over).
        calls[fault.turn] = Call(fault.turn, "allreduce", BIG_NUMEL, "float32", "SUM")
        fault = dataclasses.replace(fault, after_ms=rng.randrange(BIG_AFTER_MS))
    return Job(
        seed=seed,
        shape=shape,
        machines=machines,
        calls=tuple(calls),
        fault=fault,
        env=_env(rng),
        group_timeout_s=_timeout(fault.kind),
        mirror_gloo=fault.kind in ("kill", "leave", "freeze"),
    )


def _timeout(kind: str) -> float:
    """The group's timeout: short where it ends the job, long where nothing may need it."""
    if kind in ("freeze", "start_kill", "skip"):
        return FREEZE_TIMEOUT_S
    return SLOW_TIMEOUT_S if kind in ("slow", "partition") else GROUP_TIMEOUT_S
