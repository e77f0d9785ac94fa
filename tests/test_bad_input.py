"""Bad input: broken configuration on some or all ranks, and tensors or ops that
allreduce does not take.

Configuration (one bare job, tests/test_config.py has the single-process unit tests):
each case sets the variables on the ranks it names, then every rank calls
init_process_group; a bad value must fail it on *every* rank, with a message naming
the variable, and no rank may wait beyond the init timeout. The ranks start each case
together (a store barrier), and each case has its own store prefix.

Tensors: every unsupported call is made on one rank only (then on all ranks), and
must raise there at once, naming the problem; then all ranks run a valid allreduce
and check it exactly. A call refused on one rank must not consume a sequence number
there, or the next allreduce would pair different operations across ranks (and hang
or mismatch). A second job pushes hypothesis-drawn allreduces (shapes, strides,
dtypes, ops) interleaved with refused calls on random ranks through one group.
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from multiprocess import SHAPES, RankOutcome, fairring_env, launch, memoised
from reliability_helpers import BareOutcome, run_bare, store_barrier
from values import FLOAT_DTYPES as FLOATS
from values import INT_DTYPES, make_values, reference

SHAPE = SHAPES["2x2"]
WORLD = len(SHAPE)
INIT_TIMEOUT_S = 6.0
ALL = tuple(range(WORLD))


# ------------------------------------------------------------------ configuration


@dataclasses.dataclass(frozen=True)
class ConfigCase:
    id: str
    env: dict[int, dict[str, str]]  # rank -> variables set on that rank
    names: tuple[str, ...] = ()  # every rank's error must name these; () = must work


def _everywhere(**env: str) -> dict[int, dict[str, str]]:
    return {r: dict(env) for r in ALL}


def _on(ranks: tuple[int, ...], base: dict[str, str], **env: str) -> dict[int, dict[str, str]]:
    return {r: {**base, **(env if r in ranks else {})} for r in ALL}


SMALL = {"FAIRRING_SLICE_SIZE": "64K", "FAIRRING_TOTAL_MEMORY": "512K"}
S, T = "FAIRRING_SLICE_SIZE", "FAIRRING_TOTAL_MEMORY"
MID, IF, SC = "FAIRRING_MACHINE_ID", "TP_SOCKET_IFNAME", "FAIRRING_SLICE_SCALING"

CONFIG_CASES = [
    # garbage, negative, zero, huge: the same on every rank
    *(
        ConfigCase(f"{var}={value}", _everywhere(**{var: value}), (var,))
        for var in (S, T)
        for value in ("banana", "-4M", "0", "2T", "25Q", "1.3")
    ),
    # accepted by the parser (<= 1 TiB) but far beyond this machine's memory
    ConfigCase(f"{T}=900G", _everywhere(**{T: "900G"}), (T,)),
    ConfigCase("slice larger than staging", _everywhere(**{S: "25M", T: "1M"}), (S, T)),
    ConfigCase(f"{MID}=empty", _everywhere(**{MID: ""}), (MID,)),
    ConfigCase(f"{MID}=spaces", _everywhere(**{MID: "   "}), (MID,)),
    ConfigCase(f"{IF}=nosuchif0", _everywhere(**{IF: "nosuchif0"}), (IF,)),
    ConfigCase(f"{IF}=empty", _everywhere(**{IF: ""}), (IF,)),
    ConfigCase(f"{SC}=maybe", _everywhere(**{SC: "maybe"}), (SC,)),
    ConfigCase(f"{SC}=empty", _everywhere(**{SC: ""}), (SC,)),
    # inconsistent: different values on different ranks
    ConfigCase(f"{S} differs on rank 3", _on((3,), SMALL, **{S: "128K"}), (S,)),
    ConfigCase(f"{T} differs on rank 1", _on((1,), SMALL, **{T: "1M"}), (T,)),
    ConfigCase(f"{SC} differs on rank 2", _on((2,), {SC: "off"}, **{SC: "on"}), (SC,)),
    ConfigCase(f"{S}=banana on rank 2 only", _on((2,), SMALL, **{S: "banana"}), (S,)),
    ConfigCase(f"{IF}=nosuchif0 on rank 1 only", _on((1,), {}, **{IF: "nosuchif0"}), (IF,)),
    # valid: must initialise and reduce exactly
    ConfigCase("valid: small slices", _everywhere(**SMALL)),
    ConfigCase(f"valid: {IF}=lo", _everywhere(**{IF: "lo"})),
    ConfigCase(f"valid: {SC}=ON", _everywhere(**{SC: "ON"})),
    ConfigCase(
        "valid: irregular machines (warns, one rank per machine)",
        {r: {MID: "m0" if r < 3 else "m1"} for r in ALL},
    ),
]


def _config_cases(rank: int, world: int, store: Any, cases: list[ConfigCase]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    pristine = dict(os.environ)
    for i, case in enumerate(cases):
        os.environ.clear()
        os.environ.update(pristine)
        os.environ.update(case.env.get(rank, {}))
        store_barrier(store, f"barrier/{i}", world, timeout_s=120)
        t0 = time.monotonic()
        try:
            dist.init_process_group(
                "fairring",
                store=dist.PrefixStore(f"case{i}/", store),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=INIT_TIMEOUT_S),
            )
        except Exception as exc:  # noqa: BLE001 - the message is the result
            results[case.id] = {
                "error": f"{type(exc).__name__}: {exc}",
                "elapsed_s": time.monotonic() - t0,
            }
            continue
        elapsed = time.monotonic() - t0
        try:
            t = torch.arange(3000, dtype=torch.float32) * (rank + 1)
            dist.all_reduce(t)
            exact = torch.equal(t, torch.arange(3000, dtype=torch.float32) * 10)
            results[case.id] = {"error": None, "elapsed_s": elapsed, "exact": exact}
        except Exception as exc:  # noqa: BLE001 - reported
            results[case.id] = {
                "error": None,
                "elapsed_s": elapsed,
                "exact": False,
                "why": str(exc),
            }
        finally:
            dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(pristine)
    return results


@memoised
def _config_job() -> tuple[BareOutcome, ...]:
    return tuple(run_bare(_config_cases, SHAPE, timeout_s=300, cases=CONFIG_CASES))


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[c.id for c in CONFIG_CASES])
def test_config_fails_on_every_rank(case: ConfigCase) -> None:
    outcomes = _config_job()
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(o.describe() for o in bad)
    problems = []
    for o in outcomes:
        r = o.value[case.id]
        if not case.names:
            if r["error"] is not None or not r.get("exact"):
                problems.append(f"rank {o.rank}: valid configuration failed: {r}")
            continue
        if r["error"] is None:
            problems.append(f"rank {o.rank}: init_process_group succeeded")
            continue
        missing = [name for name in case.names if name not in r["error"]]
        if missing:
            problems.append(f"rank {o.rank}: error does not name {missing}: {r['error']}")
        # Every rank fails promptly; one waiting for a peer that gave up may take up
        # to the init timeout, never longer.
        if r["elapsed_s"] > INIT_TIMEOUT_S + 5:
            problems.append(f"rank {o.rank}: failed only after {r['elapsed_s']:.1f} s")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ unsupported tensors


def _opts(op: Any = dist.ReduceOp.SUM) -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


def _invalid_call(kind: str) -> None:
    """Make one unsupported allreduce call of ``kind`` (it should raise)."""
    pg = dist.group.WORLD
    if kind in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
        dist.all_reduce(torch.ones(16).to(getattr(torch, kind)))
    elif kind == "complex64_backend":
        # dist.all_reduce turns complex SUM into a float view; the backend itself must
        # refuse complex.
        assert pg is not None
        pg.allreduce([torch.ones(16, dtype=torch.complex64)], _opts()).wait()
    elif kind in ("BAND", "BOR", "BXOR"):
        dist.all_reduce(torch.ones(16, dtype=torch.int32), op=getattr(dist.ReduceOp, kind))
    elif kind == "PREMUL_SUM":
        dist.all_reduce(torch.ones(16), op=dist._make_nccl_premul_sum(2.0))
    elif kind == "AVG_int32":
        dist.all_reduce(torch.ones(16, dtype=torch.int32), op=dist.ReduceOp.AVG)
    elif kind == "AVG_bool":
        dist.all_reduce(torch.ones(16, dtype=torch.bool), op=dist.ReduceOp.AVG)
    elif kind == "sparse_coo":
        dist.all_reduce(torch.eye(4).to_sparse())
    elif kind == "two_tensors":
        assert pg is not None
        pg.allreduce([torch.ones(16), torch.ones(16)], _opts()).wait()
    elif kind == "coalesced_mixed_dtype":
        # Past torch's own Python check, straight to the backend.
        assert pg is not None
        tensors = [torch.ones(4), torch.ones(4, dtype=torch.float64)]
        pg.allreduce_coalesced(tensors, dist.AllreduceCoalescedOptions()).wait()
    elif kind == "coalesced_mixed_device":
        dist.all_reduce_coalesced([torch.ones(4), torch.empty(4, device="meta")])
    elif kind == "coalesced_uint16":
        dist.all_reduce_coalesced([torch.ones(4, dtype=torch.uint16)] * 2)
    else:
        raise ValueError(kind)


# kind -> what the error must name; a tuple lists equivalent spellings (torch's C++
# name of a dtype, or Python's)
INVALID: dict[str, tuple[str | tuple[str, ...], ...]] = {
    "uint16": (("UInt16", "torch.uint16"),),
    "uint32": (("UInt32", "torch.uint32"),),
    "uint64": (("UInt64", "torch.uint64"),),
    "float8_e4m3fn": (("Float8_e4m3fn", "torch.float8_e4m3fn"),),
    "float8_e5m2": (("Float8_e5m2", "torch.float8_e5m2"),),
    "complex64_backend": (("ComplexFloat", "torch.complex64"),),
    "BAND": ("BAND",),
    "BOR": ("BOR",),
    "BXOR": ("BXOR",),
    "PREMUL_SUM": ("PREMUL_SUM",),
    "AVG_int32": ("AVG", ("Int", "torch.int32")),
    "AVG_bool": ("AVG", ("Bool", "torch.bool")),
    "sparse_coo": (("Sparse", "sparse"),),
    "two_tensors": ("exactly one tensor",),
    "coalesced_mixed_dtype": ("dtype",),
    "coalesced_mixed_device": (("Meta", "meta"),),
    "coalesced_uint16": (("UInt16", "torch.uint16"),),
}


def missing_words(message: str, words: tuple[str | tuple[str, ...], ...]) -> list[str]:
    """The entries of ``words`` that ``message`` does not name (in any spelling)."""
    out = []
    for word in words:
        spellings = (word,) if isinstance(word, str) else word
        if not any(w in message for w in spellings):
            out.append(" or ".join(spellings))
    return out


def _exact_check(rank: int, world: int, tag: str) -> str | None:
    """A valid allreduce on every rank, checked exactly."""
    seed = zlib.crc32(tag.encode())
    n = 1000 + seed % 5000
    t = torch.arange(n, dtype=torch.float32) + rank
    dist.all_reduce(t)
    expected = torch.arange(n, dtype=torch.float32) * world + sum(range(world))
    return None if torch.equal(t, expected) else f"valid allreduce after {tag} was wrong"


def _try_invalid(kind: str) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        _invalid_call(kind)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed_s": time.monotonic() - t0}
    return {"error": None, "elapsed_s": time.monotonic() - t0}


def _invalid_calls(rank: int, world: int, kinds: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for i, kind in enumerate(kinds):
        # On one rank only (a different one each time), then on every rank.
        for who, ranks in (("one", (i % world,)), ("all", ALL)):
            entry: dict[str, Any] = {}
            if rank in ranks:
                entry = _try_invalid(kind)
            try:
                entry["after"] = _exact_check(rank, world, f"{kind}/{who}")
            except Exception as exc:  # noqa: BLE001 - reported
                entry["after"] = f"valid allreduce after {kind}/{who} raised: {exc}"
            results[f"{kind}/{who}"] = entry
    # Meta tensors never reach a backend: torch's meta kernel for c10d::allreduce_
    # answers first. Whatever it does, the group must stay in step.
    if rank == 1:
        results["meta"] = _try_meta()
    results["meta/after"] = _exact_check(rank, world, "meta")
    return results


def _try_meta() -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.empty(16, device="meta"))
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return {"error": str(exc), "elapsed_s": time.monotonic() - t0}
    return {"error": None, "elapsed_s": time.monotonic() - t0}


@memoised
def _invalid_job() -> tuple[RankOutcome, ...]:
    return tuple(
        launch(
            _invalid_calls,
            WORLD,
            SHAPE,
            env=fairring_env(slice_size=64 * 1024, total_memory=512 * 1024),
            timeout_s=180,
            # A sequence number consumed on one rank only would hang the next
            # allreduce: let it fail at a short timeout instead.
            pg_timeout_s=30,
            kinds=list(INVALID),
        )
    )


@pytest.mark.parametrize("kind", list(INVALID))
def test_unsupported_call_raises_at_once_and_group_stays_usable(kind: str) -> None:
    outcomes = _invalid_job()
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    problems = []
    for who in ("one", "all"):
        for o in outcomes:
            entry = o.value[f"{kind}/{who}"]
            if "elapsed_s" in entry:  # this rank made the call
                if entry["error"] is None:
                    problems.append(f"{who}: rank {o.rank}: the call did not raise")
                else:
                    missing = missing_words(entry["error"], INVALID[kind])
                    if missing:
                        problems.append(
                            f"{who}: rank {o.rank}: error lacks {missing}: {entry['error']}"
                        )
                    if entry["elapsed_s"] > 1.0:
                        problems.append(f"{who}: rank {o.rank}: took {entry['elapsed_s']:.2f} s")
            if entry["after"] is not None:
                problems.append(f"{who}: rank {o.rank}: {entry['after']}")
    assert not problems, "\n".join(problems)


def test_meta_tensor_keeps_the_group_in_step() -> None:
    outcomes = _invalid_job()
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    assert outcomes[1].value["meta"]["elapsed_s"] < 1.0
    after = [o.value["meta/after"] for o in outcomes if o.value["meta/after"] is not None]
    assert not after, after


# ------------------------------------------------------------------ hypothesis


INTS = ("int8", "int16", "int32", "int64", "uint8")
DTYPES = FLOATS + INTS + ("bool",)
OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
VIEWS = ("contiguous", "transposed", "every_other", "offset", "channels_last")
REFUSED = ("uint16", "float8_e5m2", "BXOR", "PREMUL_SUM", "two_tensors", "coalesced_mixed_dtype")


@dataclasses.dataclass(frozen=True)
class Valid:
    shape: tuple[int, ...]
    dtype: str
    op: str
    view: str
    seed: int
    asynchronous: bool


@dataclasses.dataclass(frozen=True)
class Refused:
    kind: str
    ranks: tuple[int, ...]


_valid_steps = st.builds(
    Valid,
    shape=st.lists(st.integers(0, 24), min_size=0, max_size=4).map(tuple),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    view=st.sampled_from(VIEWS),
    seed=st.integers(0, 2**31 - 1),
    asynchronous=st.booleans(),
)
_refused_steps = st.builds(
    Refused,
    kind=st.sampled_from(REFUSED),
    ranks=st.sets(st.integers(0, WORLD - 1), min_size=1).map(lambda s: tuple(sorted(s))),
)
_steps = st.one_of(_valid_steps, _valid_steps, _valid_steps, _refused_steps)


def draw_steps(count: int) -> list[Valid | Refused]:
    """``count`` steps drawn by hypothesis (its edge-seeking generation: empty shapes,
    zero-sized dimensions, extreme seeds), deterministically, for one job. The job is
    the expensive part, so hypothesis does not run it once per example."""
    drawn: list[Valid | Refused] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(_steps)
    def collect(step: Valid | Refused) -> None:
        drawn.append(step)

    collect()
    return drawn


def _values(step: Valid, rank: int, numel: int) -> torch.Tensor:
    """tests/values.py's inputs: integers across their dtype's range (exact, in any
    order), small integers for floats (exact in every float dtype)."""
    kind = "wide" if step.dtype in INT_DTYPES else "small"
    return make_values(f"bad_input/{step.seed}", rank, step.op, step.dtype, numel, WORLD, kind)


def _base_and_view(step: Valid, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = step.shape
    if step.view == "every_other":
        shape = (2 * shape[0], *shape[1:]) if shape else (2,)
    elif step.view == "offset":
        shape = (shape[0] + 3, *shape[1:]) if shape else (4,)
    elif step.view == "channels_last" and len(shape) != 4:
        shape = (*shape, 1, 1, 1, 1)[:4] if len(shape) < 4 else shape[:4]
    numel = 1
    for d in shape:
        numel *= d
    base = _values(step, rank, numel).reshape(shape)
    if step.view == "transposed":
        view = base.t() if base.dim() == 2 else base.transpose(0, -1) if base.dim() else base
    elif step.view == "every_other":
        view = base[::2]
    elif step.view == "offset":
        view = base[3:]
    elif step.view == "channels_last":
        base = base.contiguous(memory_format=torch.channels_last)
        view = base
    else:
        view = base
    return base, view


def _reference(views: list[torch.Tensor], op: str, dtype: str) -> torch.Tensor:
    expected, tolerance = reference(views, op, dtype)
    assert tolerance is None or not bool(tolerance.any()), (op, dtype)  # exact inputs only
    return expected


def _run_steps(rank: int, world: int, steps: list[Valid | Refused]) -> list[str]:
    errors: list[str] = []
    pending: list[tuple[int, Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def settle_pending() -> None:
        for i, work, base, view, expected_base, expected_view in pending:
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - reported
                errors.append(f"step {i} {steps[i]}: wait raised {exc}")
                continue
            if not torch.equal(view, expected_view):
                errors.append(f"step {i} {steps[i]}: wrong result")
            elif not torch.equal(base, expected_base):
                errors.append(f"step {i} {steps[i]}: elements outside the view changed")
        pending.clear()

    for i, step in enumerate(steps):
        if isinstance(step, Refused):
            settle_pending()  # refused calls come between completed operations
            if rank in step.ranks:
                result = _try_invalid(step.kind)
                if result["error"] is None or result["elapsed_s"] > 1.0:
                    errors.append(f"step {i} {step}: {result}")
            continue
        refused = step.op == "AVG" and step.dtype not in FLOATS
        bases = [_base_and_view(step, r) for r in range(world)]
        base, view = _base_and_view(step, rank)
        op = getattr(dist.ReduceOp, step.op)
        if refused:
            settle_pending()
            try:
                dist.all_reduce(view, op=op)
                errors.append(f"step {i} {step}: AVG on {step.dtype} was not refused")
            except Exception as exc:  # noqa: BLE001 - expected
                if "AVG" not in str(exc):
                    errors.append(f"step {i} {step}: unclear error {exc}")
            continue
        # The expected base: this rank's input outside the view, the reduction inside.
        expected_base = base.clone(memory_format=torch.preserve_format)
        _, ev = _view_of_clone(step, expected_base)
        ev.copy_(_reference([v for _, v in bases], step.op, step.dtype))
        work = dist.all_reduce(view, op=op, async_op=True)
        pending.append((i, work, base, view, expected_base, ev))
        if not step.asynchronous or len(pending) > 8:
            settle_pending()
    settle_pending()
    final = _exact_check(rank, world, "end of hypothesis steps")
    if final is not None:
        errors.append(final)
    return errors


def _view_of_clone(step: Valid, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same view as _base_and_view takes, of another tensor of the same layout."""
    if step.view == "transposed":
        view = base.t() if base.dim() == 2 else base.transpose(0, -1) if base.dim() else base
    elif step.view == "every_other":
        view = base[::2]
    elif step.view == "offset":
        view = base[3:]
    else:
        view = base
    return base, view


HYPOTHESIS_STEPS = 150


def test_hypothesis_random_allreduces_with_refused_calls_between() -> None:
    steps = draw_steps(HYPOTHESIS_STEPS)
    assert any(isinstance(s, Refused) for s in steps) and any(isinstance(s, Valid) for s in steps)
    outcomes = launch(
        _run_steps,
        WORLD,
        SHAPE,
        env=fairring_env(slice_size=1024, total_memory=8 * 1024),
        timeout_s=240,
        pg_timeout_s=30,
        steps=steps,
    )
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    errors = [f"rank {o.rank}: {e}" for o in outcomes for e in o.value]
    assert not errors, "\n".join(errors[:40])
