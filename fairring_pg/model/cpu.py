"""CPU tensors: fairring's engine (src/pipeline/) against Gloo's ring, over TCP.

Both are modelled on M machines of L ranks, each machine with one link of a given rate
per direction (tc-shaped in the netns cluster), or none (loopback): the model is
validated against the namespace cluster of fairring_pg/tools/netns_cluster.py, where every
simulated machine shares this host's cores, and that is the default here.

fairring, per pipeline chunk ("segment") of a slice, on one rank (m, l):
  reduce-scatter   (L > 1) read (L-1)/L of the chunk from the local peers (a memory copy,
                   process_vm_readv) and add it into my part;
  collect          (M > 1) the machine sends (M-1)/M of the chunk over its link (each of
                   its L ranks (M-1)/M of its part);
  reduce           (M > 1) add the M-1 received shards, (M-1)/M of my part;
  diffuse          (M > 1) the same bytes back over the link;
  all-gather       (L > 1) read (L-1)/L of the chunk from the local peers.
Slices hold a staging slot until their shards are reduced; FAIRRING_TOTAL_MEMORY gives
the number of slots. Gloo: a ring over the N = M·L ranks in rank order, which crosses
each machine's link once per direction, carrying 2(N-1)/N of the tensor, in 2(N-1)
steps; ProcessGroupGloo runs two operations at a time (its default two threads).

The CPU is one pool of cores shared by every rank placed on it: each rank's CPU work
(copies, reductions, TCP at the measured cost per byte) counts times
max(1, ranks on the host / cores).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from fairring_pg.config import Config
from fairring_pg.model.calibration import Primitives
from fairring_pg.model.pipeline import FlowTime, Piece, Stage, flow_time
from fairring_pg.sizing import staging_slot_bytes

# ProcessGroupGloo's default worker threads (torch's ProcessGroupGloo::Options): at
# most this many Gloo collectives run at once.
GLOO_THREADS = 2
# Gloo's ring never sends more than this per message (gloo/allreduce.h kMaxSegmentSize).
GLOO_MAX_SEGMENT = 1 << 20
# Bodies below this go through the socket between local ranks rather than being read
# straight from the peer's memory (src/transport/memory_reader).
MEMORY_READ_MIN = 64 << 10


@dataclass(frozen=True)
class CpuCluster:
    machines: int
    ranks_per_machine: int
    link_bytes_per_s: float | None  # nominal, per machine and direction; None: no link limit
    link_efficiency: float = 1.0  # payload share one TCP stream gets (measured)
    shared_host: bool = True  # every machine simulated on this host (the netns cluster)

    def __post_init__(self) -> None:
        if self.machines < 1 or self.ranks_per_machine < 1:
            raise ValueError(
                f"a cluster needs at least one machine of one rank, got {self.machines} "
                f"machine(s) of {self.ranks_per_machine}"
            )

    @property
    def world(self) -> int:
        return self.machines * self.ranks_per_machine

    @property
    def payload_bytes_per_s(self) -> float | None:
        if self.link_bytes_per_s is None:
            return None
        return self.link_bytes_per_s * self.link_efficiency

    def contention(self, cores: int) -> float:
        """How much slower a rank's CPU work runs than on a core of its own."""
        on_host = self.world if self.shared_host else self.ranks_per_machine
        return max(1.0, on_host / max(1, cores))


@dataclass(frozen=True)
class CpuPrediction:
    fairring: FlowTime
    gloo: FlowTime
    assumptions: list[str] = field(default_factory=list)

    @property
    def fairring_s(self) -> float:
        return self.fairring.seconds

    @property
    def reference_s(self) -> float:
        return self.gloo.seconds

    @property
    def reference(self) -> str:
        return "gloo ring"

    @property
    def speedup(self) -> float:
        """Gloo's time over fairring's (above 1: fairring is faster)."""
        return self.reference_s / self.fairring_s if self.fairring_s > 0 else 1.0


def predict_cpu(
    cluster: CpuCluster,
    sizes: Sequence[int],
    primitives: Primitives,
    config: Config | None = None,
    elem_size: int = 4,
) -> CpuPrediction:
    """Seconds for allreduces of ``sizes`` bytes issued at once (one size: one call),
    until the last completes, on fairring and on Gloo."""
    config = config or Config()
    return CpuPrediction(
        fairring=fairring_time(cluster, sizes, primitives, config, elem_size),
        gloo=gloo_time(cluster, sizes, primitives, elem_size),
        assumptions=assumptions(cluster, primitives, config),
    )


def fairring_time(
    cluster: CpuCluster,
    sizes: Sequence[int],
    primitives: Primitives,
    config: Config,
    elem_size: int = 4,
) -> FlowTime:
    M, L = cluster.machines, cluster.ranks_per_machine
    if M * L == 1:
        return flow_time([])
    # What FAIRRING_CPU_ALLREDUCE hands to Gloo's ring (one rank per machine, from 1 MiB).
    ring_from = config.cpu_ring_from(M, L)
    ring = [s for s in sizes if 0 <= ring_from <= s]
    if ring:
        on_ring = gloo_time(cluster, ring, primitives, elem_size)
        rest = [s for s in sizes if not 0 <= ring_from <= s]
        if not rest:
            return on_ring
        # Both at once share the link: no faster than one after the other.
        on_engine = fairring_time(
            cluster,
            rest,
            primitives,
            dataclasses.replace(config, cpu_allreduce="engine"),
            elem_size,
        )
        return FlowTime(
            on_ring.seconds + on_engine.seconds,
            "Gloo's ring and the engine",
            {
                k: on_ring.loads.get(k, 0.0) + on_engine.loads.get(k, 0.0)
                for k in {*on_ring.loads, *on_engine.loads}
            },
            on_engine.fill,
            on_ring.drain,
        )
    slice_bytes = config.effective_slice_size(M, L)
    slots = max(1, config.total_memory // max(1, staging_slot_bytes(slice_bytes, M, L)))
    pieces: list[Piece] = []
    slot_holds = 0.0
    for size in sizes:
        numel = size // elem_size
        slice_elems = max(1, slice_bytes // elem_size)
        segment_elems = segment_size(slice_elems, config.pipeline_chunk // elem_size, L, M)
        for begin in range(0, max(numel, 1), slice_elems):
            length = min(slice_elems, numel - begin)
            segments = [
                segment_stages(cluster, primitives, min(segment_elems, length - g) * elem_size)
                for g in range(0, max(length, 1), segment_elems)
            ]
            pieces += segments
            slot_holds += flow_time(segments).seconds
    return flow_time(pieces, {"staging slots": slot_holds / slots})


def segment_size(slice_elems: int, chunk_elems: int, L: int, M: int) -> int:
    """Elements of a pipeline chunk: L chunks of FAIRRING_PIPELINE_CHUNK rounded down to a
    multiple of L·M, the whole slice with one machine (SliceCuts::fitSegment)."""
    if M == 1:
        return slice_elems
    unit = L * M
    fitted = max(unit, chunk_elems * L // unit * unit)
    return slice_elems if fitted >= slice_elems else fitted


def segment_stages(cluster: CpuCluster, p: Primitives, nbytes: int) -> Piece:
    """The five steps of one pipeline chunk of ``nbytes``, on one rank."""
    M, L = cluster.machines, cluster.ranks_per_machine
    k = cluster.contention(p.cores)
    part = nbytes / L  # my chunk of it
    local = (L - 1) * part  # what I read from (or give to) my local peers
    read = local / p.copy_bytes_per_s
    if part < MEMORY_READ_MIN:
        read = local * p.tcp_cpu_s_per_byte
    stages = []
    if L > 1:
        add = local / p.reduce_bytes_per_s
        stages.append(
            Stage("reduce-scatter", {"cpu": k * (read + add), "reducer": k * add}, p.message_s)
        )
    if M > 1:
        wire = (M - 1) / M * nbytes  # what the machine's link carries, each way
        mine = (M - 1) / M * part  # what I send (and receive)
        tcp = k * mine * p.tcp_cpu_s_per_byte
        link = {"link": wire / cluster.payload_bytes_per_s} if cluster.payload_bytes_per_s else {}
        add = k * mine / p.reduce_bytes_per_s
        stages += [
            Stage("collect", {**link, "cpu": tcp}, p.message_s),
            Stage("reduce", {"cpu": add, "reducer": add}),
            Stage("diffuse", {**link, "cpu": tcp}, p.message_s),
        ]
    if L > 1:
        stages.append(Stage("all-gather", {"cpu": k * read}, p.message_s))
    return Piece(tuple(stages))


def gloo_time(
    cluster: CpuCluster, sizes: Sequence[int], p: Primitives, elem_size: int = 4
) -> FlowTime:
    """Gloo's ring: each op a reduce-scatter then an all-gather around the N ranks."""
    N = cluster.world
    if N == 1:
        return flow_time([])
    k = cluster.contention(p.cores)
    pieces = []
    for size in sizes:
        moved = (N - 1) / N * size  # per rank and phase, sent and received
        link = {}
        if cluster.machines > 1 and cluster.payload_bytes_per_s:
            link = {"link": moved / cluster.payload_bytes_per_s}
        tcp = k * moved * p.tcp_cpu_s_per_byte
        add = k * moved / p.reduce_bytes_per_s
        # Each phase passes every segment N - 1 hops around the ring; two are in flight.
        hops = (N - 1) * p.message_s
        pieces.append(
            Piece(
                (
                    Stage("ring reduce-scatter", {**link, "cpu": tcp + add}, hops),
                    Stage("ring all-gather", {**link, "cpu": tcp}, hops),
                )
            )
        )
    threads = sum(piece.critical_path for piece in pieces) / GLOO_THREADS
    return flow_time(pieces, {"gloo threads": threads})


def assumptions(cluster: CpuCluster, p: Primitives, config: Config) -> list[str]:
    M, L = cluster.machines, cluster.ranks_per_machine
    slice_bytes = config.effective_slice_size(M, L)
    slots = config.total_memory // max(1, staging_slot_bytes(slice_bytes, M, L))
    link = (
        f"each machine's link moves {cluster.link_bytes_per_s / 1e6:.1f} MB/s per direction, "
        f"{cluster.link_efficiency:.1%} of it payload (one TCP stream, measured)"
        if cluster.link_bytes_per_s
        else "no link limit between machines (loopback): CPU-bound, which the model predicts "
        "about 40% too fast (37-66% below the measured times for the engine's loopback runs "
        "from 4 MiB: docs/design.md, 'What the model leaves out'): it leaves out the "
        "scheduling and wake-ups of many threads on few cores, and is validated only with "
        "a link limit"
    )
    where = "all machines on this host" if cluster.shared_host else "each machine like this host"
    return [
        link,
        f"{where}: {p.cores} cores shared by {cluster.world if cluster.shared_host else L} "
        f"ranks; one core copies {p.copy_bytes_per_s / 1e9:.1f} GB/s, adds "
        f"{p.reduce_bytes_per_s / 1e9:.1f} GB/s; TCP costs "
        f"{p.tcp_cpu_s_per_byte * 1e9:.2f} CPU-ns per byte; a message "
        f"{p.message_s * 1e6:.0f} us",
        f"fairring: slice {slice_bytes} B, pipeline chunk {config.pipeline_chunk} B per local "
        f"rank, {slots} staging slot(s) of FAIRRING_TOTAL_MEMORY={config.total_memory}",
        *(
            [
                f"fairring: allreduces of {ring_from} B and more go to Gloo's ring "
                "(one rank per machine)"
            ]
            if (ring_from := config.cpu_ring_from(M, L)) >= 0
            else []
        ),
        f"Gloo: ring over {cluster.world} ranks in rank order, {GLOO_THREADS} operations at once",
    ]
