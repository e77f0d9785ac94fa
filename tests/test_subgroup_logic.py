"""The sub-group path's logic that needs no GPU and no peers, through the core's bindings.

- Same-memory ordering (src/subgroups/in_flight_ops.*): which earlier allreduces a new
  operation must wait for is decided by the bytes each touches, not by the storage: two
  views of one buffer that do not meet run in parallel (a gradient buffer cut into
  buckets), views that meet run in call order. A strided view counts from its first
  element to its last (its gaps included, so conservative).
- CUDA graph capture (src/subgroups/capture_probe.*): what the driver's answer means,
  and a driver that cannot be asked is said once, not silently taken for "no capture".
- Draining at destroy (src/subgroups/drain.*): ends as soon as everything is done, at
  once after a failure, and at the deadline otherwise.
- planUnits without slices: one direct unit, whatever the size.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch


@pytest.fixture(scope="module")
def core() -> Any:
    """The test-only module (tests/native/subgroup_bindings.cpp): the core's logic laid
    out, linked against the core."""
    import native_module

    return native_module.load()


def extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes from t's first element to one past its last, from its layout."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


# ------------------------------------------------------------------ byte ranges

BUF = torch.zeros(64, 32)  # 8 KiB of float32


@pytest.mark.parametrize(
    "view",
    [
        pytest.param(BUF, id="whole"),
        pytest.param(BUF[3:7], id="rows"),
        pytest.param(BUF[5], id="one-row"),
        pytest.param(BUF[:, 4], id="column"),
        pytest.param(BUF[2:9, 3:11], id="block"),
        pytest.param(BUF.t(), id="transposed"),
        pytest.param(BUF[::3, ::2], id="strided"),
        pytest.param(BUF.view(-1)[7:8], id="one-element"),
        pytest.param(BUF.view(torch.int8)[3:5], id="bytes"),
        pytest.param(BUF[4:5].expand(3, 32), id="expanded"),
    ],
)
def test_byte_range_is_the_views_extent(core: Any, view: torch.Tensor) -> None:
    assert core.byte_ranges([view]) == [extent(view)]
    begin, end = core.byte_ranges([view])[0]
    assert BUF.data_ptr() <= begin < end <= BUF.data_ptr() + BUF.nbytes


def test_empty_and_undefined_touch_nothing(core: Any) -> None:
    assert core.byte_ranges([BUF[3:3], torch.empty(0)]) == []


def test_explicit_ranges(core: Any) -> None:
    """A few by hand, not through the same formula."""
    base = BUF.data_ptr()
    flat = BUF.view(-1)
    assert core.byte_ranges([flat[10:20]]) == [(base + 40, base + 80)]
    # Column 4 of 64 rows of 32: elements 4, 36, ..., 4 + 63*32; last one ends 4 bytes on.
    assert core.byte_ranges([BUF[:, 4]]) == [(base + 16, base + (4 + 63 * 32) * 4 + 4)]


# ------------------------------------------------------------------ ordering

CASES = {
    # name: (view issued first, view issued second, must the second wait)
    "disjoint buckets": (slice(0, 1000), slice(1000, 2048), False),
    "adjacent ends": (slice(0, 1024), slice(1024, 1025), False),
    "far apart": (slice(0, 10), slice(2000, 2048), False),
    "overlapping": (slice(0, 1001), slice(1000, 2048), True),
    "contained": (slice(0, 2048), slice(500, 600), True),
    "containing": (slice(500, 600), slice(0, 2048), True),
    "same view": (slice(10, 20), slice(10, 20), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flat_views_wait_only_where_their_bytes_meet(core: Any, name: str) -> None:
    first, second, waits = CASES[name]
    flat = BUF.view(-1)
    ops = core.InFlightOpsProbe()
    ops.add([flat[first]], 1)
    assert ops.overlapping([flat[second]]) == ([1] if waits else [])


def test_strided_views_are_conservative(core: Any) -> None:
    """Even and odd elements never share a byte, but each spans the other's range: they
    are ordered (conservative, never wrong). Rows of a 2-D buffer do not meet."""
    flat = BUF.view(-1)
    ops = core.InFlightOpsProbe()
    ops.add([flat[0::2]], 1)
    assert ops.overlapping([flat[1::2]]) == [1]
    ops = core.InFlightOpsProbe()
    ops.add([BUF[0:8, ::2]], 1)  # rows 0-7, every other column
    assert ops.overlapping([BUF[8:16, ::2]]) == []
    assert ops.overlapping([BUF[7:9, 1]]) == [1]


def test_different_storages_never_wait(core: Any) -> None:
    a, b = torch.zeros(100), torch.zeros(100)
    ops = core.InFlightOpsProbe()
    ops.add([a], 1)
    assert ops.overlapping([b]) == []
    assert ops.overlapping([b, a[99:]]) == [1]  # any tensor of an operation counts


def test_bucket_views_in_flight_together(core: Any) -> None:
    """A gradient buffer cut into four buckets, each allreduced in turn: no bucket waits
    for another; an allreduce of the whole buffer then waits for all four; and a later
    bucket waits for the whole-buffer one only."""
    flat = BUF.view(-1)
    buckets = [flat[i * 512 : (i + 1) * 512] for i in range(4)]
    ops = core.InFlightOpsProbe()
    for i, bucket in enumerate(buckets):
        assert ops.overlapping([bucket]) == [], i
        ops.add([bucket], i)
    assert ops.overlapping([flat]) == [0, 1, 2, 3]
    ops.add([flat], 4)
    assert ops.overlapping([buckets[2]]) == [2, 4]


def test_forget_drops_from_the_oldest_only(core: Any) -> None:
    """Lanes end out of order: a finished operation behind an unfinished one stays (its
    event is simply found done again); nothing is asked when nothing is forgotten."""
    flat = BUF.view(-1)
    ops = core.InFlightOpsProbe()
    for i in range(4):
        ops.add([flat[i * 10 : (i + 1) * 10]], i)
    asked: list[int] = []

    def reached(done: set[int]) -> Any:
        def ask(op_id: int) -> bool:
            asked.append(op_id)
            return op_id in done

        return ask

    ops.forget(reached({1, 2}))
    assert ops.all() == [0, 1, 2, 3] and asked == [0]
    ops.forget(reached({0, 1}))
    assert ops.all() == [2, 3]
    asked.clear()
    # overlapping() never asks: it is what runs under CUDA graph capture.
    assert ops.overlapping([flat]) == [2, 3] and asked == []


# ------------------------------------------------------------------ capture

# cuStreamIsCapturing: (CUresult, CUstreamCaptureStatus) -> what fairring makes of it.
# 906 is CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (the legacy stream while another stream is
# captured in global mode); 201 CUDA_ERROR_INVALID_CONTEXT stands for any other error.
CAPTURE = [
    ((0, 0), "none", False),
    ((0, 1), "active", True),
    ((0, 2), "invalidated", True),
    ((906, 0), "implicit", True),
    ((201, 0), "unknown", False),
    ((0, 7), "unknown", False),
]


@pytest.mark.parametrize(("answer", "state", "capturing"), CAPTURE)
def test_capture_states(core: Any, answer: tuple[int, int], state: str, capturing: bool) -> None:
    assert core.capture_state(*answer) == state
    assert core.is_capturing(state) is capturing


@pytest.mark.parametrize("library", ["libfairring-no-such-driver.so.1", "libc.so.6"])
def test_a_missing_driver_is_said_once(core: Any, library: str) -> None:
    """No library, or one without cuStreamIsCapturing: "unknown", with one warning that
    names the library, however often it is asked."""
    probe = core.CaptureProbe(library)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states = [probe.state(0) for _ in range(3)]
    assert states == ["unknown"] * 3
    said = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    assert len(said) == 1, said
    assert library in said[0] and "cuStreamIsCapturing" in said[0], said[0]


# ------------------------------------------------------------------ draining


def test_drain_ends_when_everything_is_done(core: Any) -> None:
    start = time.monotonic()
    ready_at = [start + 0.05, start + 0.1]
    end = core.drain_until(
        [lambda at=at: time.monotonic() >= at for at in ready_at],
        lambda: False,
        timedelta(seconds=20),
    )
    elapsed = time.monotonic() - start
    assert end == "drained" and 0.1 <= elapsed < 2, (end, elapsed)


def test_drain_stops_at_a_failure_well_before_the_timeout(core: Any) -> None:
    """A sub-group reports an error while an operation can never finish (its peer is
    gone): the drain ends then, not 20 s later."""
    start = time.monotonic()
    end = core.drain_until(
        [lambda: True, lambda: False],
        lambda: time.monotonic() >= start + 0.2,
        timedelta(seconds=20),
    )
    elapsed = time.monotonic() - start
    assert end == "failed" and 0.2 <= elapsed < 2, (end, elapsed)


def test_a_failure_wins_over_a_finished_drain(core: Any) -> None:
    """A sub-group in error is aborted, never shut down gracefully: NCCL's graceful
    shutdown would wait on it."""
    assert core.drain_until([lambda: True], lambda: True, timedelta(seconds=20)) == "failed"


def test_drain_times_out(core: Any) -> None:
    start = time.monotonic()
    end = core.drain_until([lambda: False], lambda: False, timedelta(milliseconds=300))
    elapsed = time.monotonic() - start
    assert end == "timed out" and 0.3 <= elapsed < 2, (end, elapsed)


# ------------------------------------------------------------------ plans


@pytest.mark.parametrize("numel", [5, 15, 16, 4096, 1_000_003])
def test_a_plan_of_nccl_makes_every_allreduce_one_direct_unit(core: Any, numel: int) -> None:
    # 4 machines x 1 rank, 4 KiB pieces: composed if the plan says so, from one group of
    # 16 bytes per rank (4 float32 each: 16 elements).
    nccl = [(0, "nccl", 0, "")]
    assert core.cut_call(numel, 4, nccl, 4096, 1, 4) == (0, [(0, numel, True)])
    row, units = core.cut_call(numel, 4, [(0, "compose", 1, "alltoall")], 4096, 1, 4)
    assert row == 0 and sum(size for _, size, _ in units) == numel
    assert any(not direct for _, _, direct in units) == (numel >= 16)


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        ([(0, "ring", 0, "")], "path is 'nccl', 'compose' or 'measure', not 'ring'"),
        ([(0, "compose", 0, "alltoall")], "at least one piece, not 0"),
        ([(0, "compose", 2, "tree")], "'alltoall' or 'reduce_scatter', not 'tree'"),
    ],
)
def test_a_bad_plan_row_is_refused_naming_it(core: Any, rows: Any, error: str) -> None:
    with pytest.raises(RuntimeError, match=error):
        core.cut_call(100, 4, rows, 4096, 2, 2)
