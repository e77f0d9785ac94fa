"""A rank killed in a big allreduce at one rank per machine, where it is Gloo's ring
(FAIRRING_CPU_ALLREDUCE): every survivor names the lost rank, which Gloo's own error
names by address only (docs/design.md, "Failure")."""

from __future__ import annotations

from killed_peer import (
    BIG_NUMEL,
    DESTROY_FAST_S,
    GROUP_TIMEOUT_S,
    JOB_TIMEOUT_S,
    gloo_slowest,
    kill_bound,
    killed_peer,
    surviving,
)
from multiprocess import SHAPES, RankOutcome, fairring_env, launch, memoised


@memoised
def _ring_kill_job(slow_to_see_close: int | None = None) -> tuple[RankOutcome, ...]:
    return tuple(
        launch(
            killed_peer,
            3,
            SHAPES["3x1"],
            # The model's rule: the ring from 1 MiB (auto would time both ways first).
            env=fairring_env(FAIRRING_CPU_ALLREDUCE="model"),
            timeout_s=JOB_TIMEOUT_S,
            abort_grace_s=45,
            group_backend="fairring",
            victim=1,
            big_numel=BIG_NUMEL,
            group_timeout_s=GROUP_TIMEOUT_S,
            yardstick=True,
            slow_to_see_close=slow_to_see_close,
        )
    )


def test_killed_peer_on_the_ring_raises_promptly() -> None:
    # One rank per machine: the 32 MiB allreduce is Gloo's ring (FAIRRING_CPU_ALLREDUCE).
    # Rank 1 dies a few ms into it: Gloo's ring fails it (or, had rank 1 died before
    # announcing it, its turn on the engine); either way every survivor raises within
    # the bound naming the lost rank, which Gloo's own error names by address only, the
    # next call (the engine's) raises at once with the same reason, and destroy is prompt.
    survivors = surviving(_ring_kill_job(), 1)
    bound = kill_bound(gloo_slowest(survivors), None)
    for o in survivors:
        v = o.value
        culprit = f"rank 1 (host {v['host']})"
        assert v["message"] is not None, f"rank {o.rank}: the allreduce completed without rank 1"
        assert culprit in v["message"], f"rank {o.rank}: does not name {culprit}: {v['message']}"
        assert v["detect_s"] <= bound, f"rank {o.rank}: {v['detect_s']:.3f} s (bound {bound:.3f} s)"
        after = v["after_message"]
        assert after is not None and culprit in after, f"rank {o.rank}: the call after: {after!r}"
        assert v["after_s"] <= 1.0, f"rank {o.rank}: the call after took {v['after_s']:.2f} s"
        assert v["destroy_s"] <= DESTROY_FAST_S, (
            f"rank {o.rank}: destroy took {v['destroy_s']:.2f} s"
        )


def test_a_ring_failure_told_by_another_rank_first_still_names_the_lost_rank() -> None:
    # Rank 2 reads its connections from rank 1 as closed only 2 s late (engine.lost) and
    # aborts 0.15 s late (engine.abort): rank 0's abort reaches it while its failed ring
    # call waits to name the lost peer, and that abort's reason is what names rank 1 there.
    survivors = surviving(_ring_kill_job(2), 1)
    assert survivors[1].rank == 2
    for o in survivors:
        v = o.value
        culprit = f"rank 1 (host {v['host']})"
        assert v["message"] is not None, f"rank {o.rank}: the allreduce completed without rank 1"
        assert culprit in v["message"], f"rank {o.rank}: does not name {culprit}: {v['message']}"
        after = v["after_message"]
        assert after is not None and culprit in after, f"rank {o.rank}: the call after: {after!r}"
