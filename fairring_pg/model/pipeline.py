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
fixed latency includes its launch); after its latency its transfers run, each
bandwidth resource shared equally by the transfers on it at the time (as flows share a
NIC). It is never below ``flow_time``.
"""

from __future__ import annotations

import heapq
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
    return _Simulation(pieces, order).run()


class _Simulation:
    """Events in time order: a stage starts when the host has issued everything before
    it, its piece's previous stage is done and it is first in each of its queues; after
    its latency its transfers run, each bandwidth resource shared equally by the
    transfers on it; it ends when the last is done, which frees its queues."""

    def __init__(self, pieces: Sequence[Piece], order: Sequence[tuple[int, int]]) -> None:
        self.stages = [pieces[i].stages[j] for i, j in order]
        index = {pair: k for k, pair in enumerate(order)}
        self.before = [index[(i, j - 1)] if j else -1 for i, j in order]
        self.after = [index.get((i, j + 1), -1) for i, j in order]
        self.issued_at: list[float] = []
        host = 0.0
        for stage in self.stages:
            self.issued_at.append(host)
            host += stage.issue
        self.queues: dict[str, list[int]] = {}
        for k, stage in enumerate(self.stages):
            for queue in stage.hold:
                self.queues.setdefault(queue, []).append(k)
        self.head = dict.fromkeys(self.queues, 0)
        n = len(self.stages)
        self.started = [False] * n
        self.done = [False] * n
        self.start = [0.0] * n
        self.end = [0.0] * n
        self.left = [0] * n  # transfers of the stage still running
        self.waking: list[tuple[float, int]] = []  # (latency over, stage)
        self.flows: dict[str, dict[int, float]] = {}  # resource -> stage -> work left

    def run(self) -> Scheduled:
        n = len(self.stages)
        issued = 0  # stages are issued in order: issued_at only grows
        now = 0.0
        finished = 0
        while finished < n:
            while issued < n and self.issued_at[issued] <= now:
                self._try_start(issued, now)
                issued += 1
            later = self.waking[0][0] if self.waking else math.inf
            if issued < n:
                later = min(later, self.issued_at[issued])
            for flows in self.flows.values():
                later = min(later, now + min(flows.values()) * len(flows))
            if later == math.inf:
                raise RuntimeError("schedule: no stage can start (a queue or order cycle)")
            later = max(now, later)
            ended = []
            for resource, flows in list(self.flows.items()):
                ended += _advance(flows, now, later)
                if not flows:
                    del self.flows[resource]
            now = later
            while self.waking and self.waking[0][0] <= now:
                _, k = heapq.heappop(self.waking)
                finished += self._transfer(k, now)
            for k in ended:
                self.left[k] -= 1
                if not self.left[k]:
                    finished += self._finish(k, now)
        timeline = tuple(
            (stage.name, self.start[k], self.end[k]) for k, stage in enumerate(self.stages)
        )
        return Scheduled(max(self.end, default=0.0), timeline)

    def _try_start(self, k: int, now: float) -> None:
        if self.started[k] or self.issued_at[k] > now:
            return
        if self.before[k] >= 0 and not self.done[self.before[k]]:
            return
        stage = self.stages[k]
        if any(self.queues[q][self.head[q]] != k for q in stage.hold):
            return
        self.started[k] = True
        self.start[k] = now
        heapq.heappush(self.waking, (now + stage.latency, k))

    def _transfer(self, k: int, now: float) -> int:
        work = {r: s for r, s in self.stages[k].busy.items() if s > 0.0}
        if not work:
            return self._finish(k, now)
        self.left[k] = len(work)
        for resource, seconds in work.items():
            self.flows.setdefault(resource, {})[k] = seconds
        return 0

    def _finish(self, k: int, now: float) -> int:
        self.done[k] = True
        self.end[k] = now
        freed = []
        for queue in self.stages[k].hold:
            self.head[queue] += 1
            if self.head[queue] < len(self.queues[queue]):
                freed.append(self.queues[queue][self.head[queue]])
        for other in [self.after[k], *freed]:
            if other >= 0:
                self._try_start(other, now)
        return 1


_EPSILON = 1e-12  # seconds: a picosecond


def _advance(flows: dict[int, float], now: float, later: float) -> list[int]:
    """The work left of the transfers sharing one resource, ``later - now`` on (the
    shortest end exactly when their finishing time is ``later``, not a rounding error
    above it); removes and returns the stages whose transfer there is done."""
    least = min(flows.values())
    ends_now = now + least * len(flows) <= later
    share = (later - now) / len(flows)
    ended = []
    for k, left in list(flows.items()):
        left = 0.0 if ends_now and left == least else left - share
        if left <= _EPSILON:
            del flows[k]
            ended.append(k)
        else:
            flows[k] = left
    return ended
