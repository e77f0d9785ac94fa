"""The wait chain's reading (src/pipeline/wait_chain.h) on notes written by hand.

Chaos seed 123 (2 x 3, rank 3 frozen at call 4) named no rank under load: rank 1 timed
out at #4 waiting for rank 0, whose only note, overwritten, was for #6 ("waits for rank
2"), and rank 2 waited for rank 0 at #4: a circle. Each note is kept under its turn now,
and a rank waited for at turn t is followed by its note for t.
"""

from __future__ import annotations

import native_module
import stream_mutants
import torch.distributed as dist

WORLD = 6
WAIT_MS = 200


def _note(store: dist.Store, rank: int, seq: int, waits: list[int], latest: bool = True) -> None:
    text = f"{seq}:{','.join(map(str, waits))}"
    store.set(f"waits/{rank}/{seq}", text)
    if latest:
        store.set(f"waits/{rank}", text)


def _follow(store: dist.Store, me: int, seq: int, waited: list[int]) -> tuple[list, int]:
    stream_mutants.arm_from_env()  # the plant, where scripts/stream_mutants.sh arms one
    links, silent = native_module.load().follow_wait_chain(store, me, seq, waited, WORLD, WAIT_MS)
    return [(rank, turn, list(whom)) for rank, turn, whom in links], silent


def test_a_rank_waiting_at_a_later_turn_too_is_followed_at_the_turn_waited_on() -> None:
    store = dist.HashStore()
    _note(store, 0, 4, [3])  # rank 0 at #4 waits for rank 3, the frozen one...
    _note(store, 0, 6, [2])  # ...and at #6 for rank 2: its latest note
    _note(store, 2, 4, [0])  # rank 2 at #4 waits for rank 0
    links, silent = _follow(store, 1, 4, [0])
    assert links == [(0, 4, [3])], links
    assert silent == 3, f"the frozen rank 3 not named: {links}, silent {silent}"
    # What rank 1 wrote: its own note for #4 and as its latest.
    assert store.get("waits/1/4") == b"4:0" and store.get("waits/1") == b"4:0"


def test_the_latest_note_stands_in_where_none_is_for_the_turn() -> None:
    store = dist.HashStore()
    # Rank 4 is blocked in Gloo's broadcast from rank 5: noted at the turn after its last.
    _note(store, 4, 9, [5])
    links, silent = _follow(store, 1, 4, [4])
    assert links == [(4, 9, [5])] and silent == 5, (links, silent)


def test_a_rank_with_no_note_is_the_one_named() -> None:
    store = dist.HashStore()
    _note(store, 2, 7, [0], latest=True)
    links, silent = _follow(store, 1, 7, [2])
    assert links == [(2, 7, [0])] and silent == 0, (links, silent)
