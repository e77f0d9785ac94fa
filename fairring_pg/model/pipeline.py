"""Time of a stream of pieces through a pipeline of shared resources.

An allreduce, as fairring runs it, is a sequence of pieces (pipeline chunks of slices
on CPU, slices on CUDA), each going through the same stages in order; a stage keeps one
or more resources busy (a link, a communicator, the CPU, a rank's reduction thread) for
some seconds, plus a latency that occupies nothing (a message's wake-up). Pieces overlap
as far as the resources and a window (staging slots, lanes) allow.

The time is the classic bound of a pipeline: the most loaded resource works without a
break, from the moment the first piece reaches it (the *fill*: the stages of the first
piece before its first stage on that resource) until the last piece leaves it (the
*drain*: the stages of the last piece after its last stage there),

    T = max( fill + max_r load_r + drain,  the critical path of any single piece ),

where load_r is the sum over pieces of the seconds each keeps r busy. A window of K
pieces in flight (staging slots, lanes) is one more resource, whose load the caller
gives: the time each piece holds it, summed, divided by K (no fill or drain).
Interleaving on a shared resource is not modelled: pieces are served as if they took
turns, which for a link shared by several TCP flows is the same total.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stage:
    name: str
    busy: Mapping[str, float] = field(default_factory=dict)  # resource -> seconds
    latency: float = 0.0  # seconds that occupy no resource (a message's wake-up)

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
    bottleneck: str  # the most loaded resource, or "critical path" when one piece rules
    loads: dict[str, float]
    fill: float
    drain: float


def flow_time(pieces: Sequence[Piece], windows: Mapping[str, float] | None = None) -> FlowTime:
    """Seconds from the first piece's start to the last piece's end (see the module);
    ``windows`` are extra resources (name -> load) with no fill or drain."""
    if not pieces:
        return FlowTime(0.0, "nothing", {}, 0.0, 0.0)
    loads: dict[str, float] = dict(windows or {})
    for piece in pieces:
        for stage in piece.stages:
            for resource, seconds in stage.busy.items():
                loads[resource] = loads.get(resource, 0.0) + seconds
    longest_path = max(p.critical_path for p in pieces)
    if not loads:
        return FlowTime(longest_path, "critical path", loads, 0.0, 0.0)
    bottleneck = max(loads, key=lambda r: loads[r])
    fill = drain = 0.0
    if not windows or bottleneck not in windows:
        fill = _until(pieces[0].stages, bottleneck, with_latency=True)
        drain = _until(tuple(reversed(pieces[-1].stages)), bottleneck, with_latency=False)
    through = fill + loads[bottleneck] + drain
    if longest_path > through:
        return FlowTime(longest_path, "critical path", loads, 0.0, 0.0)
    return FlowTime(through, bottleneck, loads, fill, drain)


def _until(stages: Sequence[Stage], resource: str, with_latency: bool) -> float:
    """Seconds of the stages before the first one that uses ``resource`` (a stage's
    latency comes before its busy time: part of the fill, not of the drain)."""
    total = 0.0
    for stage in stages:
        if resource in stage.busy:
            return total + (stage.latency if with_latency else 0.0)
        total += stage.seconds
    return total
