"""tests/values.py's integer root, which bounds the inputs of an integer PRODUCT: exact,
and quick enough that making a call's inputs never counts in its time to raise (chaos
seed 344: counting up to it took over a second inside the call's timed span)."""

from __future__ import annotations

import time

import pytest
import torch
from values import int_root, make_values

INT64_MAX = 2**63 - 1


def test_int_root_is_the_largest_root_that_fits() -> None:
    for n in range(1, 400):
        for k in range(1, 6):
            brute = max(r for r in range(1, n + 1) if r**k <= n)
            assert int_root(n, k) == brute, (n, k)
    for k in range(2, 9):
        r = int_root(INT64_MAX, k)
        assert r**k <= INT64_MAX < (r + 1) ** k, k


@pytest.mark.parametrize("world", [3, 4, 6])
def test_product_inputs_are_made_at_once_and_their_product_fits(world: int) -> None:
    start = time.perf_counter()
    inputs = [
        make_values("values/344", r, "PRODUCT", "int64", 66, world, "wide") for r in range(world)
    ]
    took = time.perf_counter() - start
    assert took < 0.1, f"{took:.3f} s to make {world} ranks' inputs"
    exact = [1] * 66
    for t in inputs:
        assert t.dtype == torch.int64
        exact = [a * int(b) for a, b in zip(exact, t.tolist(), strict=True)]
    assert all(abs(p) <= INT64_MAX for p in exact)
    assert max(abs(int(v)) for t in inputs for v in t.tolist()) > int_root(INT64_MAX, world) // 2
