"""The two rules that cut an allreduce, checked directly over many shapes (L local ranks,
M machines): SliceCuts (src/pipeline/slice_cuts.h, the CPU pipeline) and cutCall
(src/subgroups/call_cut.h, the sub-group path). Every element must be covered exactly
once, each piece must go to the local rank (chunk l) and the machine (shard m) its index
names, and the staging offsets must put each segment's pieces where the segments before
it end. The bindings (the test module's slice_cuts, its cut_call) only lay the
cuts out."""

from __future__ import annotations

import itertools
from functools import cache
from types import ModuleType
from typing import Any

import pytest

SHAPES = [(L, M) for L in (1, 2, 3, 4, 8) for M in (1, 2, 3, 5)]
SIZES = (0, 1, 2, 5, 7, 12, 59, 60, 61, 997, 1024, 4099)


def _balanced(begin: int, end: int, n: int) -> list[tuple[int, int]]:
    """Piece i of [begin, end) cut into n pieces whose sizes differ by at most one."""
    size = end - begin
    return [(begin + size * i // n, begin + size * (i + 1) // n) for i in range(n)]


@cache
def _testing() -> ModuleType:
    import native_module

    return native_module.load()


def _check_slice_cuts(numel: int, slice_elems: int, chunk_elems: int, L: int, M: int) -> None:
    cuts: dict[str, Any] = _testing().slice_cuts(numel, slice_elems, chunk_elems, L, M)
    what = f"numel={numel} slice={slice_elems} chunk={chunk_elems} L={L} M={M}"
    seg_elems = cuts["segment_elems"]
    if M > 1 and seg_elems < slice_elems:
        assert seg_elems % (L * M) == 0, what
    covered = [0] * numel
    expected_slices = max(1, -(-numel // slice_elems)) if numel else 0
    assert len(cuts["slices"]) == expected_slices, what
    for s, (begin, end, segments) in enumerate(cuts["slices"]):
        assert (begin, end) == (s * slice_elems, min(numel, (s + 1) * slice_elems)), what
        at = begin
        chunk_at, shard_at = 0, 0  # where this segment's pieces start in the staging
        for g, (sb, se, chunk_offset, shard_offset, chunks) in enumerate(segments):
            assert sb == at and se <= end and (se - sb <= seg_elems), (what, s, g)
            at = se
            assert chunk_offset == chunk_at, f"{what}: segment {g} chunk offset"
            assert shard_offset == shard_at, f"{what}: segment {g} shard offset"
            assert len(chunks) == L, what
            for local, (cb, ce, shards) in enumerate(chunks):
                # Chunk l goes to local rank l: the l-th of L balanced pieces.
                assert (cb, ce) == _balanced(sb, se, L)[local], (what, s, g, local)
                assert chunk_offset + (ce - cb) <= cuts["max_chunk_elems"], (what, s, g, local)
                assert len(shards) == M, what
                for m, (hb, he) in enumerate(shards):
                    # Shard m goes to machine m: the m-th of M balanced pieces.
                    assert (hb, he) == _balanced(cb, ce, M)[m], (what, s, g, local, m)
                    assert shard_offset + (he - hb) <= cuts["max_shard_elems"], what
                    for i in range(hb, he):
                        covered[i] += 1
            # Every chunk (shard) of a segment but the last is the same size.
            chunk_at += chunks[0][1] - chunks[0][0]
            shard_at += chunks[0][2][0][1] - chunks[0][2][0][0]
        assert at == end, what
    assert covered == [1] * numel, f"{what}: elements not covered exactly once"


@pytest.mark.parametrize(("L", "M"), SHAPES, ids=[f"{L}x{M}" for L, M in SHAPES])
def test_slice_cuts_covers_every_element_once(L: int, M: int) -> None:
    unit = L * M
    for numel, slice_units, chunk in itertools.product(SIZES, (1, 3, 16), (1, 4, 7, 64)):
        # Slices are whole multiples of 16*L*M bytes (fairring_pg.config): here of L*M.
        _check_slice_cuts(numel, slice_units * unit, chunk, L, M)


# A plan of three rows: NCCL's below 64 bytes, then composed with at least 1 piece by
# all-to-all, from 4 KiB at least 3 pieces by NCCL's reduce-scatter.
ROWS = [(0, "nccl", 0, ""), (64, "compose", 1, "alltoall"), (4096, "compose", 3, "reduce_scatter")]


# NCCL's kernels take their fast path on 16-byte aligned buffers: every piece, chunk and
# shard of a composed call starts a multiple of this many bytes into the tensor.
ALIGN = 16


def _check_call(numel: int, elem: int, largest: int, L: int, M: int) -> None:
    """cutCall against fairring_pg.model.composition.cut_pieces (the model's rule) and
    against what every cut must be: the row of the call's bytes, every element in
    exactly one unit, pieces whole groups no larger than the largest piece whose
    chunks and shards all start ALIGN bytes apart, only the tail (fewer elements than a
    group) direct."""
    from fairring_pg.model.composition import cut_pieces

    row, units = _testing().cut_call(numel, elem, ROWS, largest, L, M)
    what = f"numel={numel} elem={elem} largest={largest} L={L} M={M}"
    group = max(1, ALIGN // elem) * L * M
    nbytes = numel * elem
    assert row == max(i for i, r in enumerate(ROWS) if r[0] <= nbytes), what
    if numel == 0 or L * M == 1:
        assert units == [], what
        return
    if M == 1 or ROWS[row][1] == "nccl" or numel < group:
        assert units == [(0, numel, True)], what
        return
    model = cut_pieces(numel, elem, ROWS[row][2], largest, L, M)
    assert units == [(u.begin, u.numel, u.direct) for u in model], what
    at = 0
    for i, (begin, size, direct) in enumerate(units):
        assert begin == at and size > 0, (what, i)
        at += size
        if direct:
            assert i == len(units) - 1 and size < group, (what, i)
            continue
        assert size % group == 0 and size * elem <= largest, (what, i)
        shard = size // (L * M)
        starts = [begin + c * size // L + m * shard for c in range(L) for m in range(M)]
        assert all(x * elem % ALIGN == 0 for x in starts), (what, i, "unaligned")
    assert at == numel, f"{what}: units cover {at} of {numel} elements"
    pieces = [u for u in units if not u[2]]
    assert len(pieces) >= min(ROWS[row][2], numel // group), what
    assert max(p[1] for p in pieces) - min(p[1] for p in pieces) <= group, f"{what}: uneven"


@pytest.mark.parametrize(("L", "M"), SHAPES, ids=[f"{L}x{M}" for L, M in SHAPES])
def test_cut_call_follows_the_model_and_covers_every_element_once(L: int, M: int) -> None:
    for numel, elem, pieces in itertools.product(SIZES + (20_003,), (1, 2, 4, 8), (1, 4)):
        _check_call(numel, elem, pieces * ALIGN * L * M, L, M)
