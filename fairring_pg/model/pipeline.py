"""Time of a stream of pieces through a pipeline of shared resources.

An allreduce, as fairring runs it, is a sequence of pieces (pipeline chunks of slices
on CPU, pieces of a call on CUDA), each going through the same stages in order. A stage
waits a latency that occupies nothing (a message's wake-up, a collective's fixed cost),
then keeps bandwidth resources busy (a link, the NICs, NVLink, a CPU) for some
seconds each; it may also *hold* queues for its whole duration (a communicator, a
stream: they run one operation after another), and cost the host some seconds to issue
(the calling thread issues every stage, in order).

Two answers, for two uses:

``flow_time`` is a true lower bound on any schedule of the pieces. For every resource
r, nothing can use r before the earliest any piece reaches it (the *fill*: the stages
of a piece before its first use of r), r does its whole load one piece at a time, and
the piece that uses r last still has the stages after that use (the *drain*), so

    T >= fill_r + load_r + drain_r            for every resource r,
    T >= the critical path of any piece,      T >= window load (below),

fill_r and drain_r being the least over pieces. A window of K pieces in flight (staging
slots, Gloo's threads) is one more resource, loaded with the time each piece holds it
over K (no fill or drain: a lower bound too). ``flow_time`` returns the largest of these
bounds and names the resource that gives it. The CPU model predicts with it (its
resources are few and its pieces alike, and it is validated against measurements:
docs/design.md, "The cost model").

``schedule`` is one schedule, the one fairring's CUDA path produces: the host issues
the stages in a given order (each after its piece's previous stage), paying each
stage's issue cost one after the other; a stage starts once its piece's previous stage
is done, its queues are free (a stream runs what it was given in order) and the host
has issued everything before it (a stage's own issue cost overlaps its start, as NCCL's
fixed latency includes its launch); after its latency each bandwidth resource serves
it in the time it leaves free, stages issued earlier first (a later transfer fills the
gaps an earlier one leaves: bandwidth is shared, not reserved). It is never below
``flow_time``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stage:
    name: str
    busy: Mapping[str, float] = field(default_factory=dict)  # bandwidth resource -> seconds
    latency: float = 0.0  # seconds before the transfer that occupy no bandwidth
    hold: tuple[str, ...] = ()  # queues held for the whole stage (communicators, streams)
    issue: float = 0.0  # seconds of the host's (calling thread's) time to issue it

    @property
    def seconds(self) -> float:
        return self.latency + max(self.busy.values(), default=0.0)


@dataclass(frozen=True)
class Piece:
    stages: tuple[Stage, ...]

    @property
    def critical_path(self) -> float:
        return sum(stage.seconds for stage in self.stages)


@dataclass(frozen=True)
class FlowTime:
    seconds: float
    bottleneck: str  # the resource whose bound is largest, or "critical path"
    loads: dict[str, float]
    fill: float
    drain: float


HOST = "host"


def flow_time(pieces: Sequence[Piece], windows: Mapping[str, float] | None = None) -> FlowTime:
    """The lower bound of the module's docstring; ``windows`` are extra resources
    (name -> load) with no fill or drain."""
    if not pieces:
        return FlowTime(0.0, "nothing", {}, 0.0, 0.0)
    loads: dict[str, float] = dict(windows or {})
    fills: dict[str, float] = {}
    drains: dict[str, float] = {}
    for piece in pieces:
        for resource, (before, after) in _fill_and_drain(piece).items():
            fills[resource] = min(fills.get(resource, before), before)
            drains[resource] = min(drains.get(resource, after), after)
        for stage in piece.stages:
            for resource, seconds in stage.busy.items():
                loads[resource] = loads.get(resource, 0.0) + seconds
            for queue in stage.hold:
                loads[queue] = loads.get(queue, 0.0) + stage.seconds
            if stage.issue:
                loads[HOST] = loads.get(HOST, 0.0) + stage.issue
    if HOST in loads:
        # The host issues from time 0, one stage after another; the stage issued last
        # can start once the host has issued everything before it, and still has to run.
        last = pieces[-1].stages[-1]
        fills[HOST] = 0.0
        drains[HOST] = last.seconds - last.issue
    best = FlowTime(max(p.critical_path for p in pieces), "critical path", loads, 0.0, 0.0)
    for resource in sorted(loads, key=lambda r: -loads[r]):
        fill, drain = fills.get(resource, 0.0), drains.get(resource, 0.0)
        bound = fill + loads[resource] + drain
        if bound > best.seconds:
            best = FlowTime(bound, resource, loads, fill, drain)
    return best


def _fill_and_drain(piece: Piece) -> dict[str, tuple[float, float]]:
    """Per resource the piece uses: seconds of its stages before its first use (a
    stage's latency comes before its bandwidth is used, not before its queues are
    held) and after its last use."""
    uses: dict[str, tuple[float, float]] = {}
    start = 0.0
    total = piece.critical_path
    for stage in piece.stages:
        end = start + stage.seconds
        for resource in stage.busy:
            first = uses[resource][0] if resource in uses else start + stage.latency
            uses[resource] = (first, total - end)
        for queue in stage.hold:
            first = uses[queue][0] if queue in uses else start
            uses[queue] = (first, total - end)
        start = end
    return uses


@dataclass(frozen=True)
class Scheduled:
    seconds: float
    stages: tuple[tuple[str, float, float], ...]  # (stage name, start, end) in issue order


def schedule(pieces: Sequence[Piece], order: Sequence[tuple[int, int]] | None = None) -> Scheduled:
    """The schedule of the module's docstring. ``order``: the (piece, stage) pairs in
    the order the host issues them, each stage after its piece's previous one (default:
    piece after piece)."""
    if order is None:
        order = [(i, j) for i, piece in enumerate(pieces) for j in range(len(piece.stages))]
    host = 0.0
    queue_free: dict[str, float] = {}
    used: dict[str, list[list[float]]] = {}  # resource -> sorted, disjoint busy intervals
    done: dict[tuple[int, int], float] = {}
    timeline: list[tuple[str, float, float]] = []
    for i, j in order:
        stage = pieces[i].stages[j]
        start = max(done[(i, j - 1)] if j else 0.0, host)
        for queue in stage.hold:
            start = max(start, queue_free.get(queue, 0.0))
        host += stage.issue
        begin = start + stage.latency
        end = begin
        for resource, seconds in stage.busy.items():
            intervals = used.get(resource)
            if intervals is None:
                intervals = used[resource] = []
            end = max(end, _serve(intervals, begin, seconds))
        for queue in stage.hold:
            queue_free[queue] = end
        done[(i, j)] = end
        timeline.append((stage.name, start, end))
    return Scheduled(max(done.values(), default=0.0), tuple(timeline))


def _serve(intervals: list[list[float]], begin: float, seconds: float) -> float:
    """Serves ``seconds`` of work on a resource from ``begin`` on, in the time its
    earlier users left free (``intervals``: its busy time, sorted and disjoint); marks
    that time used and returns when the work is done."""
    if seconds <= 0.0:
        return begin
    if not intervals or begin >= intervals[-1][1]:  # the usual case: nothing to fill
        if intervals and begin == intervals[-1][1]:
            intervals[-1][1] = begin + seconds
        else:
            intervals.append([begin, begin + seconds])
        return begin + seconds
    # The first busy interval that ends after ``begin``, then the gaps from there.
    k = bisect.bisect_right(intervals, [begin, math.inf])
    if k and intervals[k - 1][1] > begin:
        k -= 1
    t, left = begin, seconds
    head, tail = intervals[:k], intervals[k:]
    filled: list[list[float]] = []
    for lo, hi in tail:
        if left > 0.0 and lo > t:
            gap = min(lo - t, left)
            filled.append([t, t + gap])
            left -= gap
            t += gap
        if left > 0.0:
            t = max(t, hi)
        filled.append([lo, hi])
    done = t
    if left > 0.0:
        filled.append([t, t + left])
        done = t + left
    merged = head
    for lo, hi in filled:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    intervals[:] = merged
    return done
