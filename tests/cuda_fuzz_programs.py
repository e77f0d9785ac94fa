"""Seeded random programs for fairring's CUDA path, drawn so that a rank's outcome on
fairring can be compared bitwise with the same rank's outcome on the NCCL stand-in alone.

Hand-written scenarios (tests/test_stream_order.py) each cover one corner of the CUDA
path; the corners multiply (kinds of collective x dtypes x ops x sizes across the plan's
rows x how and when each rank waits x which stream issued it x memory one call still
writes while the next reads it), so docs/design.md ("Testing") asks for random programs
run on fairring and on a reference. ``draw_program`` draws one: the same sequence of
collectives on every rank (c10d's contract), with per-rank choices only where a program
stays valid whatever they are (wait order, wait style, when a rank polls
``is_completed``, dropping a Work whose result a barrier or a device synchronisation
orders). Every input is exact in every order of reduction (small integers, multiples of
powers of two, AVG inputs divisible by the world size, PRODUCT of {1, 2} or {-1, 1, 2}),
so a bitwise difference is a bug, not rounding. A program never reads a result it did not
wait for: that would be a race on the stand-in too (the vehicle sees it).

tests/cuda_fuzz_rank.py runs a program on one rank (``run_program``); scripts/cuda_fuzz.py
runs many and judges them; tests/test_cuda_fuzz.py keeps fixed seeds.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Iterable

KINDS: tuple[str, ...] = (
    "allreduce",
    "allreduce_sync",
    "coalesced",
    "allgather_list_even",
    "allgather_list_uneven",
    "allgather_tensor",
    "reduce_scatter_list",
    "reduce_scatter_tensor",
    "broadcast",
    "send_recv",
    "batch_p2p",
    "all_to_all_single",
    "all_to_all",
    "barrier",
    "temporary",
    "side_stream",
    "then",
    "ddp",
    "ddp_hook",
)

DTYPES: tuple[str, ...] = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int32",
    "int64",
    "uint8",
    "int8",
)
FLOATS: frozenset[str] = frozenset({"float64", "float32", "float16", "bfloat16"})
REDUCE_OPS: tuple[str, ...] = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "int8": 1,
}
# Byte ranges of the plans' rows (scripts/cuda_fuzz.py): the delegate's own allreduce
# below 1 KiB, the all-to-all exchange to 8 KiB, NCCL's reduce-scatter on the rail above.
SIZE_ROWS: tuple[tuple[int, int], ...] = ((0, 1023), (1024, 8191), (8192, 40 * 1024))

# How a rank waits for an op before it reads the result:
#   work / future / synchronize: Work.wait(), get_future().wait(), Work.synchronize()
#     (the current stream waits; read there);
#   poll: the host polls is_completed() until it says so (read on a stream that never
#     waited); device_sync: the host waits for the whole device (torch.cuda.synchronize);
#   barrier: a later barrier() waits for it (collectives of the world group only);
#   sync: the call was blocking; then: the then() chain's future is waited.
STYLES_ALL = ("work", "future", "synchronize", "poll", "device_sync", "barrier")
# A coalesced Work's future has no event ("waiting on it orders nothing"): no `future`.
STYLES_COALESCED = ("work", "synchronize", "poll", "device_sync", "barrier")
# Point-to-point calls run on communicators of their own: a barrier orders nothing.
STYLES_P2P = ("work", "future", "synchronize", "poll", "device_sync")
STYLES_BATCH = ("work", "synchronize", "poll", "device_sync")
# Reused in place by a later allreduce (same memory, still in flight: call order).
REUSABLE_DTYPES = frozenset({"float64", "float32", "int32", "int64"})
MAX_REUSE_DEPTH = 3


@dataclasses.dataclass(frozen=True)
class Op:
    """One call of the program, the same on every rank.

    sizes: element counts, by kind: one per tensor (allreduce, coalesced, broadcast,
    send_recv, batch_p2p, then, side_stream, temporary), or one per rank (allgather and
    reduce-scatter: each rank's piece; the uneven all-gather: rank r's own size).
    splits[r][j]: what rank r sends to rank j (all-to-all). variant: the form of the call.
    reuse: the earlier op whose tensor this allreduce reduces again in place.
    """

    index: int
    kind: str
    dtype: str = "float32"
    reduce: str = "SUM"
    sizes: tuple[int, ...] = ()
    variant: str = ""
    src: int = 0
    splits: tuple[tuple[int, ...], ...] = ()
    reuse: int | None = None


@dataclasses.dataclass(frozen=True)
class Step:
    """``issue`` op, or ``resolve`` it: wait as the rank's style says, then read."""

    action: str
    op: int


@dataclasses.dataclass(frozen=True)
class RankPlan:
    styles: dict[int, str]
    steps: tuple[Step, ...]
    drop_work: frozenset[int]  # Works dropped at issue (barrier / device_sync styles)


@dataclasses.dataclass(frozen=True)
class Program:
    seed: int
    world: int
    ops: tuple[Op, ...]
    ranks: tuple[RankPlan, ...]
    consumed: frozenset[int]  # ops whose tensor a later op reduces again: not read

    def kinds(self) -> set[str]:
        return {op.kind for op in self.ops}

    def describe(self) -> str:
        return " ".join(f"{op.index}:{op.kind}" for op in self.ops)


def key(*parts: object) -> int:
    """A stable 32-bit seed for (seed, rank, op, tensor): the same in every process."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def _count(rng: random.Random, dtype: str, row: tuple[int, int], odd: bool) -> int:
    lo, hi = row
    size = ITEMSIZE[dtype]
    n = rng.randint(lo // size, hi // size)
    if lo == 0 and rng.random() < 0.3:
        n = rng.choice((0, 1))
    if odd and n > 1 and n % 2 == 0:
        n -= 1
    return max(0, min(n, hi // size))


def _numel(rng: random.Random, dtype: str, cap: int = 40 * 1024) -> int:
    row = rng.choice(SIZE_ROWS)
    return min(_count(rng, dtype, row, rng.random() < 0.5), cap // ITEMSIZE[dtype])


def _reduce_for(rng: random.Random, dtype: str, allow_avg: bool = True) -> str:
    ops = [op for op in REDUCE_OPS if op != "AVG" or (allow_avg and dtype in FLOATS)]
    return rng.choice(ops)


def _draw_op(rng: random.Random, index: int, kind: str, world: int, reusable: list[Op]) -> Op:
    dtype = rng.choice(DTYPES)
    small = 2048  # bytes per tensor of the list kinds (the delegate's: size matters less)
    if kind in ("allreduce", "allreduce_sync") and reusable and rng.random() < 0.35:
        source = rng.choice(reusable)
        reduce = rng.choice(("SUM", "MIN", "MAX"))
        return Op(index, kind, source.dtype, reduce, source.sizes, reuse=source.index)
    if kind in ("allreduce", "allreduce_sync", "then", "side_stream"):
        return Op(index, kind, dtype, _reduce_for(rng, dtype), (_numel(rng, dtype),))
    if kind == "coalesced":
        sizes = tuple(_numel(rng, dtype, 16 * 1024) for _ in range(rng.randint(2, 4)))
        variant = rng.choice(("manager", "group"))
        return Op(index, kind, dtype, _reduce_for(rng, dtype), sizes, variant)
    if kind in ("allgather_list_even", "allgather_tensor", "reduce_scatter_tensor"):
        n = _numel(rng, dtype, small)
        reduce = _reduce_for(rng, dtype) if kind.startswith("reduce") else "SUM"
        return Op(index, kind, dtype, reduce, (n,) * world)
    if kind == "reduce_scatter_list":
        n = _numel(rng, dtype, small)
        return Op(index, kind, dtype, _reduce_for(rng, dtype), (n,) * world)
    if kind == "allgather_list_uneven":
        sizes = tuple(rng.randint(0, small // ITEMSIZE[dtype]) for _ in range(world))
        if len(set(sizes)) == 1:
            sizes = (sizes[0] + 1,) + sizes[1:]
        return Op(index, kind, dtype, "SUM", sizes)
    if kind == "broadcast":
        return Op(index, kind, dtype, "SUM", (_numel(rng, dtype),), src=rng.randrange(world))
    if kind == "send_recv":
        variant = rng.choice(("isend", "blocking"))
        return Op(index, kind, dtype, "SUM", (_numel(rng, dtype, small),), variant)
    if kind == "batch_p2p":
        return Op(index, kind, dtype, "SUM", (_numel(rng, dtype, small),))
    if kind in ("all_to_all_single", "all_to_all"):
        even = rng.random() < 0.5
        per = rng.randint(0, 40)
        splits = tuple(
            tuple(per if even else rng.randint(0, 40) for _ in range(world)) for _ in range(world)
        )
        variant = "even" if even else "uneven"
        if kind == "all_to_all_single" and even and rng.random() < 0.5:
            variant = "nosplits"  # split sizes not given: equal parts
        return Op(index, kind, dtype, "SUM", (), variant, splits=splits)
    if kind == "barrier":
        return Op(index, kind)
    if kind == "temporary":
        variant = rng.choice(("gather", "reduce_scatter", "allreduce"))
        n = _numel(rng, dtype, small if variant != "allreduce" else 40 * 1024)
        reduce = "SUM" if variant == "gather" else _reduce_for(rng, dtype)
        return Op(index, kind, dtype, reduce, (n,), variant)
    if kind == "ddp":
        return Op(index, kind, "float32", "SUM", (rng.randint(1, 6), rng.randint(1, 5)))
    if kind == "ddp_hook":
        variant = rng.choice(("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"))
        return Op(index, kind, "float32", "SUM", (rng.randint(1, 6), rng.randint(1, 5)), variant)
    raise ValueError(f"unknown kind {kind!r}")


def _styles_for(op: Op) -> tuple[str, ...]:
    if op.kind in ("allreduce_sync", "barrier", "ddp", "ddp_hook"):
        return ("sync",)
    if op.kind == "send_recv" and op.variant == "blocking":
        return ("sync",)
    if op.kind == "then":
        return ("then",)
    if op.kind == "send_recv":
        return STYLES_P2P
    if op.kind == "batch_p2p":
        return STYLES_BATCH
    if op.kind == "allgather_list_uneven" or (op.kind == "coalesced" and op.variant == "manager"):
        return STYLES_COALESCED
    return STYLES_ALL


def _rank_plan(rng: random.Random, ops: tuple[Op, ...]) -> RankPlan:
    barriers = [op.index for op in ops if op.kind == "barrier"]
    styles: dict[int, str] = {}
    drop: set[int] = set()
    for op in ops:
        choices = list(_styles_for(op))
        later_barrier = any(b > op.index for b in barriers)
        if "barrier" in choices and not later_barrier:
            choices.remove("barrier")
        # A poll's host spin is slow on 2 cores: not too often.
        weights = [0.4 if c == "poll" else 1.0 for c in choices]
        styles[op.index] = rng.choices(choices, weights)[0]
        if styles[op.index] in ("barrier", "device_sync") and rng.random() < 0.5:
            drop.add(op.index)
    steps: list[Step] = []
    pending: list[int] = []
    barrier_seen: set[int] = set()  # ops issued before the latest barrier
    for op in ops:
        steps.append(Step("issue", op.index))
        if op.kind == "barrier":
            barrier_seen.update(pending)
        pending.append(op.index)
        ready = [i for i in pending if styles[i] != "barrier" or i in barrier_seen]
        if ready and rng.random() < 0.5:
            chosen = rng.sample(ready, rng.randint(1, len(ready)))
            steps.extend(Step("resolve", i) for i in chosen)
            pending = [i for i in pending if i not in chosen]
    rng.shuffle(pending)
    steps.extend(Step("resolve", i) for i in pending)
    return RankPlan(styles, tuple(steps), frozenset(drop))


def draw_program(seed: int, world: int, kinds: Iterable[str], ops: int = 16) -> Program:
    """A valid program of ``ops`` calls (kinds drawn from ``kinds``) for ``world`` ranks;
    the same seed, world and kinds give the same program in every process."""
    chosen = sorted(set(kinds))
    unknown = set(chosen) - set(KINDS)
    if unknown or not chosen:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {sorted(unknown)}")
    rng = random.Random(key("program", seed, world, ",".join(chosen), ops))
    drawn: list[Op] = []
    depth: dict[int, int] = {}
    consumed: set[int] = set()
    for index in range(ops):
        reusable = [
            op
            for op in drawn
            if op.kind == "allreduce"
            and op.index not in consumed
            and op.dtype in REUSABLE_DTYPES
            and op.reduce in ("SUM", "MIN", "MAX")
            and depth.get(op.index, 0) < MAX_REUSE_DEPTH
        ]
        op = _draw_op(rng, index, rng.choice(chosen), world, reusable)
        if op.reuse is not None:
            consumed.add(op.reuse)
            depth[index] = depth.get(op.reuse, 0) + 1
        drawn.append(op)
    ops_t = tuple(drawn)
    ranks = tuple(_rank_plan(random.Random(key("rank", seed, r)), ops_t) for r in range(world))
    return Program(seed, world, ops_t, ranks, frozenset(consumed))


def covered(seeds: Iterable[int], world_of: dict[int, int], kinds: Iterable[str]) -> set[str]:
    """The kinds the programs of ``seeds`` (world ``world_of[seed]``) contain."""
    out: set[str] = set()
    for seed in seeds:
        out |= draw_program(seed, world_of[seed], kinds).kinds()
    return out
