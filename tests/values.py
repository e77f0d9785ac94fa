"""Inputs for allreduce checks and their references, shared by the exact-result tests,
the bad-input tests and the soak (scripts/soak.py).

Three families, by ``kind``:

- "small": small integers (SUM in [-8, 8], MIN/MAX in [-100, 100], PRODUCT of 1, 2
  and -1); every dtype holds them and every reduction of them exactly, in any order.
- "wide": values that see the dtype's width and precision. Integers reach most of the
  dtype's range without overflowing the reduction (int16 far beyond int8, int32
  beyond int16, int64 beyond int32); floats are non-integers spread over several
  orders of magnitude, reduced in float64 and held to the dtype's rounding.
- "limits": integers at the ends of the dtype's range; SUM and PRODUCT wrap around
  (modulo 2**bits, as two's complement arithmetic does whatever the order), MIN and
  MAX pick the extremes.

``reference`` computes what every rank must get from all ranks' inputs, wide (int64,
exact modulo 2**64 and so modulo 2**bits; float64), and how far the result may be
from it (zero for integers, for MIN/MAX and for "small").
"""

from __future__ import annotations

import zlib

import torch

FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _generator(tag: str, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rank}".encode()))


def small_values(tag: str, rank: int, op: str, dtype: str, numel: int, world: int) -> torch.Tensor:
    """Small integers (int64), deterministic in (tag, rank)."""
    gen = _generator(tag, rank)
    if dtype == "bool":
        return torch.randint(0, 2, (numel,), generator=gen)
    unsigned = dtype == "uint8"
    if op == "SUM":
        lo, hi = (0, 8) if unsigned else (-8, 8)
        return torch.randint(lo, hi + 1, (numel,), generator=gen)
    if op == "AVG":
        # Multiples of the world size: the average is an integer, whatever the order
        # of division and summation, so it is exact in every float dtype.
        return world * torch.randint(-8, 9, (numel,), generator=gen)
    if op in ("MIN", "MAX"):
        lo, hi = (0, 200) if unsigned else (-100, 100)
        return torch.randint(lo, hi + 1, (numel,), generator=gen)
    if op == "PRODUCT":
        choices = torch.tensor([1, 2] if unsigned else [1, 2, -1, 1])
        return choices[torch.randint(0, len(choices), (numel,), generator=gen)]
    raise ValueError(op)


def _int_range(dtype: str) -> tuple[int, int]:
    info = torch.iinfo(_dtype(dtype))
    return int(info.min), int(info.max)


def _randint(lo: int, hi: int, numel: int, gen: torch.Generator) -> torch.Tensor:
    """Uniform integers in [lo, hi] (int64), also for spans beyond int64's randint."""
    if hi - lo < 2**62:
        offsets = torch.randint(0, hi - lo + 1, (numel,), generator=gen, dtype=torch.int64)
        return offsets + lo
    # The whole int64 range: random bits, reinterpreted.
    low = torch.randint(0, 2**32, (numel,), generator=gen, dtype=torch.int64)
    high = torch.randint(-(2**31), 2**31, (numel,), generator=gen, dtype=torch.int64)
    return high * 2**32 + low


def int_root(n: int, k: int) -> int:
    """The largest r with r**k <= n (n >= 1). Counting up to it took 2 million steps
    for int64 and 3 ranks, over a second of a loaded host inside a call's timed span
    (chaos seed 344)."""
    r = max(1, int(round(n ** (1.0 / k))))
    while r**k > n:
        r -= 1
    while (r + 1) ** k <= n:
        r += 1
    return r


def _wide_int(gen: torch.Generator, op: str, dtype: str, numel: int, world: int) -> torch.Tensor:
    lo, hi = _int_range(dtype)
    if op in ("SUM", "AVG"):  # AVG: inputs for a call that must be refused
        # As wide as the dtype allows without overflowing the sum of `world` values.
        return _randint(lo // world + 1 if lo else 0, hi // world, numel, gen)
    if op in ("MIN", "MAX"):
        return _randint(lo, hi, numel, gen)
    if op == "PRODUCT":
        # |v| up to the world-th root of the maximum: the product fits, barely.
        v = _randint(1, int_root(hi, world), numel, gen)
        if lo < 0:
            v = v * (1 - 2 * torch.randint(0, 2, (numel,), generator=gen))
        return v
    raise ValueError(op)


def _limit_int(gen: torch.Generator, op: str, dtype: str, numel: int) -> torch.Tensor:
    lo, hi = _int_range(dtype)
    near = min(50, (hi - lo) // 4)
    top = _randint(hi - near, hi, numel, gen)
    bottom = _randint(lo, lo + near, numel, gen)
    return torch.where(torch.randint(0, 2, (numel,), generator=gen).bool(), top, bottom)


def _wide_float(gen: torch.Generator, op: str, dtype: str, numel: int) -> torch.Tensor:
    """Non-integers (float64) over several orders of magnitude, then rounded to
    ``dtype`` so that every rank's input is exactly what the reference adds up."""
    mantissa = torch.rand(numel, generator=gen, dtype=torch.float64) + 0.5  # [0.5, 1.5)
    sign = 1 - 2 * torch.randint(0, 2, (numel,), generator=gen).double()
    if op == "PRODUCT":
        v = sign * mantissa * 1.3  # [0.65, 1.95): products stay in range
    else:
        scale = 2.0 ** torch.randint(-6, 10, (numel,), generator=gen).double()
        v = sign * mantissa * scale
    return v.to(_dtype(dtype)).to(torch.float64)


def _fraction_values(
    tag: str, rank: int, op: str, dtype: str, numel: int, world: int
) -> torch.Tensor:
    """Integers and binary fractions across most of ``dtype``'s exact range, in float64
    (floats) or int64: exact in ``dtype``, and so are all partial results of ``op``
    over ``world`` ranks (the reduce-scatter's and all-gather's tests)."""
    gen = _generator(tag, rank)

    def ints(lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi + 1, (numel,), generator=gen, dtype=torch.int64)

    if dtype == "bool":
        return ints(0, 1)
    if op == "PRODUCT":
        choices = {
            "uint8": [1, 2, 3],
            "float32": [0.5, 1.0, 1.5, 2.0, -1.0, -0.25],
            "float64": [0.5, 1.0, 1.5, 2.0, -1.0, -0.25],
            "float16": [0.5, 1.0, 1.5, 2.0, -1.0],
            "bfloat16": [0.5, 1.0, 1.5, 2.0, -1.0],
        }.get(dtype, [1, 2, -1, 3, -2])
        table = torch.tensor(choices, dtype=torch.float64 if dtype in FLOAT_DTYPES else torch.int64)
        return table[ints(0, len(choices) - 1)]
    wide = op in ("MIN", "MAX")
    if dtype in FLOAT_DTYPES:
        # (integer range, fraction): sums of `world` values stay exact in the dtype.
        span, step = {
            "float32": (4000, 0.25) if not wide else (10**6, 0.125),
            "float64": (10**9, 0.125),
            "float16": (60, 0.25) if not wide else (2000, 0.5),
            "bfloat16": (10, 0.5) if not wide else (200, 1.0),
        }[dtype]
        values = ints(-span, span).to(torch.float64) * step
        if dtype == "float64" and not wide:
            values += 2.0**30  # beyond float32's precision, still exact sums in float64
    else:
        span = {
            "int8": 30 if not wide else 127,
            "int16": 8000 if not wide else 32000,
            "int32": 10**8 if not wide else 2**31 - 1,
            "int64": 2**40 if not wide else 2**62,
            "uint8": 60 if not wide else 255,
        }[dtype]
        lo = 0 if dtype == "uint8" else -span
        values = ints(lo, span)
    if op == "AVG":
        values = values * world  # the average is exact too
    return values


def make_values(
    tag: str, rank: int, op: str, dtype: str, numel: int, world: int, kind: str = "small"
) -> torch.Tensor:
    """One rank's input, in ``dtype``, deterministic in (tag, rank): every test's values.
    ``kind``: "small" integers (exact everywhere), "fractions" (exact sums across most
    of the dtype's range), "wide" (the dtype's width and precision: compare with
    reference()'s tolerance), "limits" (integers at the dtype's ends)."""
    if kind == "fractions":
        return _fraction_values(tag, rank, op, dtype, numel, world).to(_dtype(dtype))
    if kind == "small" or dtype == "bool":
        return small_values(tag, rank, op, dtype, numel, world).to(_dtype(dtype))
    gen = _generator(f"{kind}/{tag}", rank)
    if dtype in FLOAT_DTYPES:
        if kind != "wide":
            raise ValueError(f"no {kind} values for {dtype}")
        return _wide_float(gen, op, dtype, numel).to(_dtype(dtype))
    if kind == "wide":
        values = _wide_int(gen, op, dtype, numel, world)
    elif kind == "limits":
        values = _limit_int(gen, op, dtype, numel)
    else:
        raise ValueError(kind)
    return values.to(_dtype(dtype))


def reference(
    inputs: list[torch.Tensor], op: str, dtype: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(expected result in ``dtype``, allowed absolute error per element in float64, or
    None where the result must be exact)."""
    if dtype == "bool":
        stacked = torch.stack(inputs)
        if op in ("SUM", "MAX"):
            return stacked.any(dim=0), None
        if op in ("MIN", "PRODUCT"):
            return stacked.all(dim=0), None
        raise ValueError(f"no bool reference for {op}")
    if dtype not in FLOAT_DTYPES:
        if op in ("MIN", "MAX"):  # a choice, never out of range
            stacked = torch.stack(inputs)
            return (stacked.amin(dim=0) if op == "MIN" else stacked.amax(dim=0)), None
        # int64 arithmetic is exact modulo 2**64, so modulo 2**bits too: wrapped as
        # the dtype's own arithmetic wraps, whatever the order.
        wide = torch.stack([t.to(torch.int64) for t in inputs])
        exact = wide.sum(dim=0) if op == "SUM" else wide.prod(dim=0)
        if dtype != "int64":
            lo, hi = _int_range(dtype)
            exact = torch.remainder(exact - lo, hi - lo + 1) + lo
        return exact.to(_dtype(dtype)), None
    wide = torch.stack([t.to(torch.float64) for t in inputs])
    world = len(inputs)
    if op in ("MIN", "MAX"):
        out = wide.amin(dim=0) if op == "MIN" else wide.amax(dim=0)
        return out.to(_dtype(dtype)), None
    if op in ("SUM", "AVG"):
        exact = wide.sum(dim=0)
        magnitude = wide.abs().sum(dim=0)
        if op == "AVG":
            exact, magnitude = exact / world, magnitude / world
    elif op == "PRODUCT":
        exact = wide.prod(dim=0)
        magnitude = exact.abs()
    else:
        raise ValueError(op)
    # Reducing `world` values in the dtype, in any order (and dividing once, for AVG):
    # at most `world` roundings, each within half an ulp (eps/2) of what it rounds,
    # which is never more than the sum of magnitudes; then the cast of the reference.
    eps = torch.finfo(_dtype(dtype)).eps
    tolerance = (world + 2) * eps / 2 * magnitude
    # Small integers (every partial result too) are exact in every dtype, bfloat16's
    # 8 significant bits included.
    integers = (wide == wide.round()).all(dim=0) & (exact == exact.round())
    exact_here = integers & (wide.abs().sum(dim=0) <= 2**8)
    tolerance = torch.where(exact_here, torch.zeros_like(tolerance), tolerance)
    return exact.to(_dtype(dtype)), tolerance


def compare(
    got: torch.Tensor, expected: torch.Tensor, tolerance: torch.Tensor | None, what: str
) -> str | None:
    """None if ``got`` is ``expected`` (within ``tolerance`` of it, where given),
    else the first difference."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return (
            f"{what}: got {got.dtype}{tuple(got.shape)}, "
            f"expected {expected.dtype}{tuple(expected.shape)}"
        )
    if tolerance is None or not bool(tolerance.any()):
        bad = (got != expected).flatten()
    else:
        err = (got.to(torch.float64) - expected.to(torch.float64)).abs().flatten()
        bad = ~(err <= tolerance.flatten())
    if not bool(bad.any()):
        return None
    index = bad.nonzero().flatten()
    first = int(index[0])
    g, e = got.flatten()[first].item(), expected.flatten()[first].item()
    allowed = "" if tolerance is None else f" (within {float(tolerance.flatten()[first]):.3g})"
    return (
        f"{what}: {index.numel()} of {got.numel()} elements differ; first at flat index "
        f"{first}: got {g!r}, expected {e!r}{allowed}"
    )


def reduce_op(name: str) -> torch.distributed.ReduceOp.RedOpType:
    """dist.ReduceOp by name (SUM, AVG, MIN, MAX, PRODUCT)."""
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name)


def compare_exact(got: torch.Tensor, expected: torch.Tensor, what: str) -> str | None:
    """None if ``got`` is bit for bit ``expected``, else the first difference."""
    return compare(got, expected, None, what)
