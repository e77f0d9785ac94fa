"""The plants: bugs the CUDA path (and the measured choice) once had or could have, each a
test-only switch in the core (src/faults/plants.h), and the tests that must catch it.

``python tests/stream_mutants.py`` (what ``bash scripts/stream_mutants.sh`` runs, and
``.ci/run`` with it) arms each plant in turn (``FAIRRING_TEST_PLANT``, read by the rank
before its group exists) and runs the tests that should catch it, with their jobs cut to
the scenarios they read (``FAIRRING_TEST_SCENARIOS``). It prints ``NAME: caught by TEST``
(the first test that failed) or ``NAME: NOT CAUGHT``, and exits non-zero if any plant
was not caught. The tests pass without a plant: that is the suite's own run.

    python tests/stream_mutants.py                 # every plant
    python tests/stream_mutants.py keep_alive_off  # some
    python tests/stream_mutants.py --jobs 1        # one at a time
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

PLANT_VARIABLE = "FAIRRING_TEST_PLANT"
TESTS = Path(__file__).resolve().parent


def arm_from_env() -> None:
    """In a rank: put back the bug FAIRRING_TEST_PLANT names (the test module refuses a
    name no plant has)."""
    name = os.environ.get(PLANT_VARIABLE)
    if name:
        import native_module

        native_module.load().plants.arm(name)


@dataclasses.dataclass(frozen=True)
class Catch:
    tests: tuple[str, ...]  # pytest node ids under tests/
    scenarios: tuple[str, ...]  # what test_stream_order's jobs must run for them
    # Whether the bug shows as a rank that dies (a null Work dereferenced): only then
    # does a crashed rank count as the catch; elsewhere a crash is some other bug.
    crashes: bool = False


ORDER = "test_stream_order.py::"
CORNERS = "test_stream_corners.py::"
CATCHERS: dict[str, Catch] = {
    # DDP's reducer waits on the future, not on the Work.
    "future_on_caller_stream": Catch(
        (f"{ORDER}test_no_race_and_exact[2x2-future_wait]",), ("future_wait",)
    ),
    # With one rank per machine the first step is a lane's.
    "lane_skips_caller_wait": Catch(
        (f"{ORDER}test_no_race_and_exact[3x1-future_wait]",), ("future_wait",)
    ),
    "lanes_not_joined": Catch(
        (f"{ORDER}test_no_race_and_exact[3x1-future_wait]",), ("future_wait",)
    ),
    "keep_alive_off": Catch(
        (f"{ORDER}test_no_race_and_exact[3x1-freed_at_once]",), ("freed_at_once",)
    ),
    "byte_ranges_off": Catch(
        (
            f"{ORDER}test_no_race_and_exact[2x2-overlapping_views]",
            f"{ORDER}test_overlapping_views_wait_disjoint_ones_do_not[2x2]",
        ),
        ("overlapping_views", "disjoint_views"),
    ),
    "delegated_not_after_allreduce": Catch(
        (f"{ORDER}test_no_race_and_exact[2x2-delegated_after_allreduce]",),
        ("delegated_after_allreduce",),
    ),
    # A composed call first: connecting waits on the host, past the broadcast.
    "allreduce_not_after_delegated": Catch(
        (
            f"{ORDER}test_no_race_and_exact[2x2-allreduce_after_delegated]",
            f"{ORDER}test_delegated_collectives_wait_only_on_shared_memory[2x2]",
        ),
        ("future_wait", "delegated_after_allreduce", "allreduce_after_delegated"),
    ),
    "barrier_not_waiting": Catch(
        (f"{ORDER}test_no_race_and_exact[2x2-barrier_waits_for_device]",),
        ("barrier_waits_for_device",),
    ),
    "rail_skips_reduce_scatter": Catch(
        (f"{ORDER}test_no_race_and_exact[2x2-future_wait]",), ("future_wait",)
    ),
    # A composed call first, so that the group's streams exist.
    "delegated_hold_released_at_issue": Catch(
        (f"{ORDER}test_no_race_and_exact[2x2-delegated_gather_of_a_temporary]",),
        ("future_wait", "delegated_gather_of_a_temporary"),
    ),
    "direct_through_our_streams": Catch(
        (f"{ORDER}test_a_call_that_does_not_compose_is_the_delegates_own[1x2]",),
        ("direct_row_is_the_delegates",),
    ),
    "step_waits_on_host": Catch(
        (f"{ORDER}test_the_rail_exchanges_of_a_call_overlap[True]",), ("rails_run_at_once",)
    ),
    # The ranks' own times disagree: each rank's own verdict splits them (a hang until
    # the job's short timeout), the fastest rank's is the other way.
    "measured_own_times": Catch(
        ("test_measured_choice.py::test_the_slowest_ranks_times_decide_on_every_rank",), ()
    ),
    "measured_fastest_rank": Catch(
        ("test_measured_choice.py::test_the_slowest_ranks_times_decide_on_every_rank",), ()
    ),
    # The timed NCCL-way trial of a synchronous call dereferenced its null Work.
    "trial_times_no_work": Catch(
        (f"{CORNERS}test_synchronous_calls_through_a_measured_class_are_timed_and_exact",),
        (),
        crashes=True,
    ),
    # Ranks 0 and 1 enter the delegate's barrier, ranks 2 and 3 Gloo's: no rank leaves.
    "point_to_point_marks_delegate": Catch(
        (f"{CORNERS}test_point_to_point_then_barrier_does_not_hang[send_recv]",), ()
    ),
    "eventless_work_unordered": Catch(
        (f"{CORNERS}test_an_allreduce_after_a_coalesced_work_is_ordered_after_it",), ()
    ),
    # The delegate's trial turns of int16 calls raise, and the class fails.
    "trials_on_one_way_calls": Catch(
        (f"{CORNERS}test_calls_only_the_composition_takes_are_no_trials",), ()
    ),
    # Each rank's first agreement pairs with the others' first: the CPU class's figures
    # with the vehicle's on some ranks, and ties keep the program's ways.
    "agreement_by_order": Catch(
        (
            "test_measured_agreement.py::"
            "test_two_devices_deciding_from_two_threads_in_other_orders_agree",
        ),
        (),
    ),
    # Rank 1 waits for an engine allreduce's results, queued behind rank 0's unread
    # announcement of the next call on the gather track: a hang to the group's timeout.
    "announcement_parked": Catch(
        (
            "test_ring_announcement.py::"
            "test_an_announcement_ahead_of_its_call_does_not_stop_the_gather_track",
        ),
        (),
    ),
    # The callback's allreduce starts the callbacks' engine, which waits for the dead
    # rank 1's address until the group's timeout (30 s, bound 5 s).
    "callbacks_start_ignores_loss": Catch(
        (
            "test_failure_semantics.py::"
            "test_a_lost_peer_ends_the_start_of_the_callbacks_engine[inline]",
            "test_failure_semantics.py::"
            "test_a_lost_peer_ends_the_start_of_the_callbacks_engine[on_a_completion_thread]",
        ),
        (),
    ),
    # 2 x 2 freezes where a rank that times out waits for a live rank (the seeds where
    # that came first, half of them, when the rule was tightened): it names that one.
    "timeout_names_next_peer": Catch(
        ("test_chaos.py::test_a_freeze_is_named_at_the_end_of_the_wait_chain",), ()
    ),
    "ring_left_to_process": Catch(
        (
            "test_ring_given_up.py::"
            "test_a_ring_call_given_up_on_frees_its_gloo_group_when_gloo_ends_it",
        ),
        (),
    ),
    "callbacks_failure_stays_there": Catch(
        (
            "test_callbacks_failure.py::"
            "test_a_failure_under_a_callbacks_collective_fails_the_programs_later_calls",
        ),
        (),
    ),
    "close_waits_reduce_abort": Catch(
        ("test_abort_tracks.py::test_a_held_reduce_track_holds_neither_the_reason_nor_the_close",),
        (),
    ),
    "reduce_close_not_held": Catch(
        ("test_abort_tracks.py::test_a_held_reduce_track_holds_neither_the_reason_nor_the_close",),
        (),
    ),
    # A skipped broadcast pairs the next one with a call of another size on Gloo,
    # which ends the process: the ranks die.
    "delegated_unannounced": Catch(
        (
            "test_delegated_announced.py::test_a_skipped_broadcast_fails_on_every_rank_naming_both_sizes",
        ),
        (),
        crashes=True,
    ),
    # The held rank's barrier reaches Gloo before its broadcast: Gloo pairs it with the
    # others' broadcast and ends the process.
    "barrier_before_hand_over": Catch(
        ("test_delegated_announced.py::test_a_barrier_reaches_gloo_behind_every_call_before_it",),
        (),
        crashes=True,
    ),
    # Rank 0's latest note is for a later turn, which leads round in a circle.
    "wait_note_by_rank": Catch(
        (
            "test_wait_chain.py::"
            "test_a_rank_waiting_at_a_later_turn_too_is_followed_at_the_turn_waited_on",
        ),
        (),
    ),
    # A pool stream the program is handed too waits for the delegate's trial calls.
    "timer_on_pool_stream": Catch(
        ("test_trial_stream.py::test_the_timers_hold_back_none_of_the_programs_streams",),
        (),
    ),
    # A rank that is no peer of the held one times out connecting to a peer held behind it.
    "mesh_connects_in_order": Catch(
        (
            "test_startup_connect.py::test_a_rank_whose_start_fails_is_named_on_every_rank_in_time"
            "[core_held]",
        ),
        (),
    ),
    # A broken pipe named instead of the reason its peer sent ahead of its close.
    "send_failure_waits_briefly": Catch(
        ("test_send_failure_reason.py::test_a_broken_send_waits_for_the_peers_reason[sent]",),
        (),
    ),
    # A close read without an abort before it, called the peer's loss while the
    # gather track's reader still has the abort in hand.
    "held_close_ignores_late_gather": Catch(
        ("test_send_failure_reason.py::test_a_broken_send_waits_for_the_peers_reason[held]",),
        (),
    ),
}

_FAILED = re.compile(r"^FAILED (\S+)", re.MULTILINE)
# How tests/multiprocess.py describes a rank that died without reporting.
_CRASHED = re.compile(r"rank \d+:? crashed")


def run(name: str, catch: Catch) -> tuple[str | None, str]:
    """(the first test that failed, pytest's output) with plant ``name`` armed; a
    failure only by a crashed rank is no catch unless the plant is one that crashes."""
    env = {
        **os.environ,
        PLANT_VARIABLE: name,
        "FAIRRING_TEST_SCENARIOS": ",".join(catch.scenarios),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider"]
    command += [str(TESTS / test) for test in catch.tests]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    output = proc.stdout + proc.stderr
    return caught_by(proc.returncode, output, catch), output


def caught_by(returncode: int, output: str, catch: Catch) -> str | None:
    """The first test that failed in pytest's ``output``, where that is a catch."""
    failed = _FAILED.findall(output)
    if returncode == 1 and failed and (catch.crashes or not _CRASHED.search(output)):
        return failed[0].split("tests/")[-1]
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plants", nargs="*", help="plant names (default: all)")
    # Two at a time: a plant's run mostly waits (rank start-up, the vehicle's device
    # time), so two on two cores took 134 s where one at a time took 240 s.
    parser.add_argument(
        "--jobs", type=int, default=2, help="plants run at once (each job has 2 to 4 ranks)"
    )
    args = parser.parse_args(argv)
    names = args.plants or list(CATCHERS)
    unknown = [n for n in names if n not in CATCHERS]
    if unknown:
        known = ", ".join(CATCHERS)
        print(f"stream_mutants: no plant is called {', '.join(unknown)}; known: {known}")
        return 2
    start = time.monotonic()

    def timed(name: str) -> tuple[str, str | None, str, float]:
        began = time.monotonic()
        caught, output = run(name, CATCHERS[name])
        return name, caught, output, time.monotonic() - began

    missed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for name, caught, output, took in pool.map(timed, names):
            if caught:
                print(f"{name}: caught by {caught} ({took:.0f} s)", flush=True)
            else:
                missed.append(name)
                print(f"{name}: NOT CAUGHT ({took:.0f} s)\n{output[-3000:]}", flush=True)
    caught_count = len(names) - len(missed)
    took = time.monotonic() - start
    print(f"stream_mutants: {caught_count} of {len(names)} plants caught in {took:.0f} s")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
