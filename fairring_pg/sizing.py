"""The sizing rules, numbers in and numbers out: a staging slot, a lane's staging, how a
slice grows with the machines, the sub-group path's largest piece, and where the model's
rule hands a CPU allreduce to Gloo's ring. The bottom of the package: it imports nothing
of it, and everything that sizes something asks here.

M is the number of machines, L the ranks per machine; sizes are bytes.
"""

from __future__ import annotations

from fractions import Fraction

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB

# Smallest shard slice scaling aims for: below about this, fixed per-message costs
# (headers, wake-ups, a loop iteration per peer) outweigh the bytes moved.
MIN_SHARD_BYTES = 1 * MIB
# With one rank per machine the engine's five steps send as many bytes as Gloo's ring,
# which fills a link with one flow per host where the engine's all-to-all has several:
# at 4x1 on 1 Gbit/s links the engine took 0.94-0.99x Gloo's speed from 1 MiB up and
# 1.2-7.9x below it (bench/results/allreduce_sizes_netns_1gbit.md).
CPU_RING_FROM = 1 * MIB
# Every piece, chunk and shard of the sub-group path starts a multiple of this many bytes
# into the tensor: NCCL's kernels take their fast path on 16-byte aligned buffers
# (src/subgroups/call_cut.h).
PIECE_ALIGNMENT = 16


def staging_slot_bytes(slice_size: int, M: int, L: int) -> int:
    """Bytes of staging one CPU slice in flight needs on one rank: a chunk from each of
    the L-1 machine-mates and a shard from each of the M-1 other machines, each with its
    message header (8 and 16 bytes), the slot cache-line aligned."""
    if slice_size < 0 or M < 1 or L < 1:
        raise ValueError(
            f"staging_slot_bytes({slice_size}, {M}, {L}): "
            "expected slice_size >= 0, num_machines >= 1, local_size >= 1"
        )
    chunk = Fraction(slice_size, L) + 8
    shard = Fraction(slice_size, L * M) + 16
    total = (L - 1) * _ceil(chunk) + (M - 1) * _ceil(shard)
    return -(-total // 64) * 64


def lane_staging_bytes(piece_size: int, M: int, L: int) -> int:
    """Bytes of staging one lane of the sub-group path holds for pieces of up to
    ``piece_size``: the all-to-all's M copies of my shard (a chunk) and my reduced shard,
    each 256-byte aligned; the local steps and the reduce-scatter work in place."""
    chunk = piece_size // L
    return _aligned256(chunk) + _aligned256(chunk // M)


def scaled_slice_bytes(slice_size: int, scaling: bool, total_memory: int, M: int, L: int) -> int:
    """The CPU engine's slice: ``slice_size`` grown against over-sharding (a slice is cut
    into L*M shards; at many machines they get so small that per-message costs dominate)
    until every shard has MIN_SHARD_BYTES, but never so far that fewer than two slices fit
    in ``total_memory`` (that would serialise the pipeline)."""
    if not scaling:
        return slice_size
    wanted = max(slice_size, MIN_SHARD_BYTES * M * L)
    while wanted > slice_size and 2 * staging_slot_bytes(wanted, M, L) > total_memory:
        wanted = max(slice_size, wanted // 2)
    return wanted


def largest_piece_bytes(
    slice_size: int, scaling: bool, lanes: int, total_memory: int, M: int, L: int
) -> int:
    """The sub-group path's largest piece: ``slice_size`` grown against over-sharding as
    for the CPU path, cut to the largest size that lets each of ``lanes`` lanes hold its
    staging within ``total_memory``, a multiple of PIECE_ALIGNMENT*L*M bytes so that a
    piece of any dtype splits into L chunks of M shards, each aligned. Raises ValueError
    naming the variables where not even the smallest piece fits."""
    unit = PIECE_ALIGNMENT * M * L
    wanted = max(slice_size, MIN_SHARD_BYTES * M * L) if scaling else slice_size
    wanted = max(unit, wanted // unit * unit)

    def fits(size: int) -> bool:
        return lanes * lane_staging_bytes(size, M, L) <= total_memory

    if not fits(unit):
        need = lanes * lane_staging_bytes(unit, M, L)
        raise ValueError(
            f"FAIRRING_TOTAL_MEMORY={total_memory} cannot hold a staging slot for each of "
            f"FAIRRING_LANES={lanes} lanes with {M} machine(s) of {L} rank(s), even for the "
            f"smallest slice ({unit} bytes): expected FAIRRING_TOTAL_MEMORY >= {need}, or "
            "fewer lanes"
        )
    lo, hi = 1, wanted // unit  # in units; fits(lo * unit) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * unit) else (lo, mid - 1)
    return lo * unit


def cpu_ring_from(mode: str, M: int, L: int) -> int:
    """Bytes from which the model's rule (FAIRRING_CPU_ALLREDUCE=model, and what the cost
    model predicts for auto) gives a CPU allreduce to Gloo's ring, -1 for never: the ring
    only where the engine sends a ring's bytes (one rank per machine, several machines)."""
    if mode == "gloo":
        return 0
    if mode == "engine" or L > 1 or M == 1:
        return -1
    return CPU_RING_FROM


def _ceil(x: Fraction) -> int:
    return -(-x.numerator // x.denominator)


def _aligned256(n: int) -> int:
    return -(-n // 256) * 256
