"""Strangers: what listens, and what happens when something that is not a rank of
the job connects.

fairring listens only during start-up (docs/design.md, Transport). The listener is
its own: it reads exactly one fixed-size hello from each connection and lets in only
a peer of this rank that names itself with the job token on the right listener;
anything else is closed with nothing beyond those bytes read. Once every peer has
connected, the listeners are closed, so afterwards a connect is refused outright.

One 2x2 job checks it all:

* start-up: rank 3 builds its core only after rank 0 has thrown, at every address
  ranks 1 and 2 advertised (``addr/{rail,local}/<rank>`` in the group's store; they
  are rank 3's peers, whose listeners stay open until it connects, where rank 0's
  close once ranks 1 and 2 are in), random
  bytes, an HTTP request, a header claiming 2^64 bytes, a hello with a wrong job
  token, hellos with the right token naming a rank that is no peer or a peer that
  belongs on the other listener, a port scan (connect and close, 200 times), a real
  second ``FairringBackend`` with a wrong token, and has left open a silent
  connection and one that sent half a hello; while rank 3 connects, a storm of
  silent connections (more than a listener lets wait) hits the listeners it needs.
  No rank can finish start-up before rank 3 connects, so all of these reach open
  listeners. Each one that sent bytes must be closed at once: a hello with the
  gate's magic after a refusal naming why, anything else without an answer; the
  silent ones by the end of init; and the group must form and compute exactly;
* after init: every rank checks its listening sockets (/proc/net/tcp against the
  descriptors it holds): none beyond loopback, and none at an advertised address; a
  connect to every advertised address is refused (ECONNREFUSED);
* while all ranks run allreduces checked exactly, rank 0 throws the same strangers
  again (each must be refused at connect), a connect/close storm, and two real
  second backends: one with a wrong job token, one with the right token claiming
  rank 3, which is connected already. Both must fail to join, no rank may crash, and
  the ranks' socket descriptors must not grow.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import SHAPES, RankOutcome, fairring_env, launch, memoised
from reliability_helpers import (
    WIRE_VERSION,
    count_resources,
    group_store,
    is_loopback,
    listener_addresses,
    listening_sockets,
    parse_url,
    redirect_store,
    second_backend,
    settle,
)
from strangers import (
    MUTES,
    STRANGERS,
    TALKERS,
    WRONG_TOKEN,
    _capture_hello,
    _closed_by_peer,
    _connect,
    _payload,
    _refused,
    _try_stranger,
)

SHAPE = SHAPES["2x2"]
WORLD = len(SHAPE)
GROUP_TIMEOUT_S = 8.0
ENV = fairring_env(slice_size=16 * 1024, total_memory=128 * 1024)
STRANGER_TIMEOUT_S = 3.0
# How long a stranger waits for the rank to close its connection.
CLOSE_GRACE_S = 5.0


# ---------------------------------------------------------------- start-up


def _next_group_store() -> Any:
    """The store the *next* new_group's backend will get (torch names groups by a
    counter and prefixes the default store with the name, then with the device)."""
    c10d = dist.distributed_c10d
    default_store = c10d._world.pg_map[c10d._get_default_group()][1]
    name = str(c10d._world.group_count)
    return dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", default_store))


def _new_group_after(rank: int, act: Any) -> Any:
    """``dist.new_group`` where rank 0 runs ``act(core_store, keys, token)`` on a thread
    once ranks 1 and 2 have published every address, and rank 3 builds its core only
    after that (so their listeners cannot close before ``act`` is over: each waits for
    rank 3, its peer). Returns the group, or raises what new_group raised."""
    store = _next_group_store()
    core = dist.PrefixStore("fairring/core/", store)
    worker = None
    if rank == 0:

        def run() -> None:
            try:
                keys = [f"addr/{reach}/{r}" for r in (1, 2) for reach in ("rail", "local")]
                # Poll: Store.wait holds the GIL, and this rank's main thread needs it.
                deadline = time.monotonic() + 60
                while not core.check(keys) and time.monotonic() < deadline:
                    time.sleep(0.01)
                act(core, keys, store.get("fairring/job_token").decode())
            finally:
                core.set("startup/done", "1")

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
    ext = real_backend = None
    if rank == 3:
        # Everything before the core (config and topology exchange, the Gloo delegate)
        # needs all ranks, so the delay has to sit right here.
        from fairring_pg._build import load_extension

        ext = load_extension()
        real_backend = ext.FairringBackend

        def after_rank0(*args: Any, **kwargs: Any) -> Any:
            core.wait(["startup/done"], timedelta(seconds=120))
            return real_backend(*args, **kwargs)

        ext.FairringBackend = after_rank0
    try:
        return dist.new_group(backend="fairring", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    finally:
        if ext is not None:
            ext.FairringBackend = real_backend
        if worker is not None:
            worker.join(timeout=120)


def _startup_strangers(
    hello: bytes, held: dict[str, socket.socket], results: dict[str, Any], storm: _SilentStorm
) -> Any:
    """Rank 0's strangers against listeners of a group that is still starting."""

    def act(core: Any, keys: list[str], token: str) -> None:
        targets = {key[len("addr/") :]: parse_url(core.get(key).decode()) for key in keys}
        talkers: dict[str, dict[str, str]] = {}
        for kind in TALKERS:
            sockets = {}
            for name, addr in targets.items():
                s = _connect(addr)
                s.sendall(_payload(kind, hello, name, token))
                sockets[name] = s
            talkers[kind] = _closed_by_peer(sockets, CLOSE_GRACE_S)
            for s in sockets.values():
                s.close()
        results["startup_talkers"] = talkers
        for kind in MUTES:
            for name, addr in targets.items():
                s = _connect(addr)
                s.sendall(_payload(kind, hello, name, token))
                held[f"{kind} {name}"] = s
        scan: dict[str, int] = {}
        for i in range(200):  # a port scanner: connect, close
            outcome = _refused(targets[sorted(targets)[i % len(targets)]])
            scan[outcome] = scan.get(outcome, 0) + 1
        results["startup_scan"] = scan
        results["startup_backend"] = second_backend(redirect_store(core.get), 3, WRONG_TOKEN)
        # Rank 3 starts connecting as this returns: keep a storm of silent connections
        # going at the two listeners it needs (rank 2's local, rank 1's rail), more
        # than a gate lets wait at once, until the group has formed.
        storm.start([targets["local/2"], targets["rail/1"]])

    return act


class _SilentStorm:
    """Opens silent connections at ``targets`` in turn and holds every one of them
    (so a gate's waiting list stays full: a peer gets in only if the gate evicts a
    stranger for it), until stopped or ``MAX_OPEN`` are held."""

    KEEP_OPEN = 100
    MAX_OPEN = 4000

    def __init__(self) -> None:
        self.opened = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, targets: list[tuple[str, int]]) -> None:
        """Returns once every target has ``KEEP_OPEN`` silent connections (the gates
        let 64 wait): they are full before rank 3 starts; the storm goes on on a
        thread."""
        open_: list[list[socket.socket]] = [
            [_connect(addr) for _ in range(self.KEEP_OPEN)] for addr in targets
        ]
        self.opened = len(targets) * self.KEEP_OPEN
        self._thread = threading.Thread(target=self._run, args=(targets, open_), daemon=True)
        self._thread.start()

    def _run(self, targets: list[tuple[str, int]], open_: list[list[socket.socket]]) -> None:
        try:
            while not self._stop.is_set():
                for i, addr in enumerate(targets):
                    if self.opened >= self.MAX_OPEN:
                        self._stop.wait(0.01)
                        continue
                    try:
                        open_[i].append(_connect(addr))
                        self.opened += 1
                    except OSError as exc:  # refused once the listener closes
                        self.errors.append(type(exc).__name__)
                        self._stop.wait(0.01)
        finally:
            for socks in open_:
                for s in socks:
                    s.close()

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        return self.opened


# ---------------------------------------------------------------- the job


def _attack(group: Any, hello: bytes, results: dict[str, Any]) -> None:
    """Rank 0's strangers against the group's advertised addresses (on a thread)."""
    targets = {name: parse_url(url) for name, url in listener_addresses(WORLD, group).items()}
    core = dist.PrefixStore("fairring/core/", group_store(group))
    token = group_store(group).get("fairring/job_token").decode()
    outcomes: dict[str, str] = {}

    def join_as_rank3(who: str, token: str) -> None:
        outcomes[who] = second_backend(redirect_store(core.get), 3, token, STRANGER_TIMEOUT_S)

    threads = [
        threading.Thread(target=join_as_rank3, args=("wrong_token", "ff" * 16)),
        threading.Thread(target=join_as_rank3, args=("impostor_rank3", token)),
    ]
    for t in threads:
        t.start()
    results["strangers"] = {
        kind: {
            name: _try_stranger(addr, kind, hello, name, token) for name, addr in targets.items()
        }
        for kind in STRANGERS
    }
    storm: dict[str, int] = {}
    for i in range(200):  # connect/close storm
        name = sorted(targets)[i % len(targets)]
        outcome = _refused(targets[name])
        storm[outcome] = storm.get(outcome, 0) + 1
    results["storm"] = storm
    for t in threads:
        t.join(timeout=STRANGER_TIMEOUT_S + 30)
    results["second_backends"] = dict(outcomes)


def _run_attack(group: Any, hello: bytes, results: dict[str, Any]) -> None:
    try:
        _attack(group, hello, results)
    except BaseException as exc:  # noqa: BLE001 - reported by the tests
        import traceback

        results["attack_error"] = traceback.format_exc()
        raise exc


def _sizes(round_: int) -> list[int]:
    return [0, 1, 7, 1000, 5000, 40_000, 100_003][round_ % 7 :] + [3 * round_ + 1]


def _strangers_job(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    hello = _capture_hello() if rank == 0 else b""
    held: dict[str, socket.socket] = {}
    storm = _SilentStorm()
    group = _new_group_after(rank, _startup_strangers(hello, held, results, storm))
    dist.all_reduce(torch.ones(10), group=group)  # every rank is past init
    if rank == 0:
        results["startup_storm"] = storm.stop()
        results["startup_mutes"] = _closed_by_peer(held, CLOSE_GRACE_S)
        for s in held.values():
            s.close()
        addrs = listener_addresses(world, group)
        results["targets"] = addrs
        # At once: init returns after the listeners are closed.
        results["refused"] = {name: _refused(parse_url(url)) for name, url in addrs.items()}
    dist.all_reduce(torch.ones(10), group=group)  # rank 0's checks are over
    results["listening"] = listening_sockets()
    before = count_resources()
    attacker = None
    if rank == 0:
        attacker = threading.Thread(target=_run_attack, args=(group, hello, results), daemon=True)
        attacker.start()
    errors = []
    checked = 0
    try:
        for round_ in range(10_000):
            for n in _sizes(round_):
                t = torch.arange(n, dtype=torch.float32) * (rank + 1) + round_
                dist.all_reduce(t, group=group)
                expected = torch.arange(n, dtype=torch.float32) * 10 + world * round_
                checked += 1
                if not torch.equal(t, expected):
                    errors.append(f"round {round_}: allreduce of {n} elements was wrong")
            # Stop together: rank 0 says when its attacks are over.
            done = torch.tensor([1 if attacker is not None and not attacker.is_alive() else 0])
            dist.all_reduce(done, op=dist.ReduceOp.MAX, group=group)
            if done.item():
                break
    except Exception as exc:  # noqa: BLE001 - reported; rank 0 still reports its attacks
        errors.append(f"allreduce raised: {exc}")
        if attacker is not None:
            attacker.join(timeout=60)
    results["checked"] = checked
    results["errors"] = errors
    after_resources = settle(count_resources, before)
    results["socket_growth"] = after_resources.socket_fds - before.socket_fds
    return results


@memoised
def _job() -> tuple[RankOutcome, ...]:
    return tuple(launch(_strangers_job, WORLD, SHAPE, env=ENV, timeout_s=240, abort_grace_s=60))


def _ok(outcomes: tuple[RankOutcome, ...]) -> None:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)


def _rank0(outcomes: tuple[RankOutcome, ...]) -> dict[str, Any]:
    _ok(outcomes)
    value = outcomes[0].value
    assert value is not None, outcomes[0].describe()
    assert "attack_error" not in value, value["attack_error"]
    return value


# ---------------------------------------------------------------- the tests: start-up


# What each stranger must get during start-up: a hello with the gate's magic is told
# why it is refused (so that a real rank with a wrong setting fails at once, saying
# why); anything else is closed with no answer at all.
STARTUP_ANSWERS = {
    "other_version_hello": {"refused: wrong version"},
    "random_bytes": {"closed", "reset"},
    "http": {"closed", "reset"},
    "length_2^64": {"closed", "reset"},
    # Garbage follows the hello unread, so the close may be a reset that overtakes the
    # refusal.
    "wrong_token_hello": {"refused: wrong token", "reset"},
    "right_token_no_peer": {"refused: not a peer"},
    "right_token_wrong_listener": {"refused: wrong listener"},
}


@pytest.mark.parametrize("kind", TALKERS)
def test_startup_strangers_that_talk_are_closed_at_once(kind: str) -> None:
    got = _rank0(_job())["startup_talkers"][kind]
    # The rail and local listener of ranks 1 and 2, all open (rank 3 is not in yet).
    assert len(got) == 2 * 2, got
    wrong = {name: v for name, v in got.items() if v not in STARTUP_ANSWERS[kind]}
    assert not wrong, f"{kind} during start-up: expected {STARTUP_ANSWERS[kind]}, got {wrong}"


def test_startup_connections_that_never_say_hello_are_closed_at_init() -> None:
    outcomes = _job()
    held = _rank0(outcomes)["startup_mutes"]
    assert len(held) == len(MUTES) * 2 * 2, held
    still_open = {name: v for name, v in held.items() if v not in ("closed", "reset")}
    assert not still_open, f"start-up connections the ranks did not close: {still_open}"


def test_a_port_scan_during_startup_does_not_break_the_group() -> None:
    outcomes = _job()
    scan = _rank0(outcomes)["startup_scan"]
    # The scan met open listeners (nothing was refused: start-up was not over) ...
    assert scan == {"accepted": 200}, scan
    # ... and the group formed and computed exactly (every rank ran the job).
    for o in outcomes:
        assert not o.value["errors"], o.value["errors"][:10]


def test_a_storm_of_silent_connections_does_not_keep_a_peer_out() -> None:
    outcomes = _job()
    opened = _rank0(outcomes)["startup_storm"]
    # Both gates were full (100 silent connections each against a limit of 64) before
    # rank 3 started, and new ones kept coming while it connected; the group formed
    # (rank 0 got here) and computed exactly.
    assert opened > 2 * 100, f"the storm opened only {opened} connections"
    for o in outcomes:
        assert not o.value["errors"], o.value["errors"][:10]


def test_a_second_backend_with_a_wrong_token_is_refused_during_startup() -> None:
    ending = _rank0(_job())["startup_backend"]
    # Told why at once, not left to its timeout.
    assert ending.startswith("refused") and "the job tokens differ" in ending, ending


def test_ranks_log_why_they_refused_and_keep_accepting() -> None:
    outcomes = _job()
    _ok(outcomes)
    for o in outcomes[1:3]:  # the ranks whose listeners the strangers reached
        refusals = [line for line in o.log_tail.splitlines() if "refused a connection from" in line]
        assert refusals, f"rank {o.rank} logged no refusal:\n{o.log_tail[-2000:]}"
        other = f"wire version {WIRE_VERSION + 1}, this rank version {WIRE_VERSION}"
        assert any(other in line for line in refusals), refusals
        assert len(refusals) <= 5, f"rank {o.rank} logged {len(refusals)} refusals (limit 5)"
    stopped = [
        line for o in outcomes for line in o.log_tail.splitlines() if "stopped accepting" in line
    ]
    assert not stopped, "\n".join(stopped)


# ---------------------------------------------------------------- the tests: after init


def test_nothing_listens_beyond_loopback_nor_at_an_advertised_address() -> None:
    outcomes = _job()
    targets = _rank0(outcomes)["targets"]
    # A 2x2 job: every rank published a rail and a local address, on 127.0.0.1.
    assert len(targets) == 2 * WORLD, targets
    advertised = {parse_url(url) for url in targets.values()}
    assert {host for host, _ in advertised} == {"127.0.0.1"}, targets
    problems = []
    for o in outcomes:
        listening = o.value["listening"]
        wild = [a for a in listening if not is_loopback(a[0])]
        if wild:
            problems.append(f"rank {o.rank}: listening beyond loopback: {wild}")
        still = sorted(set(listening) & advertised)
        if still:
            problems.append(f"rank {o.rank}: still listening at advertised {still}")
    assert not problems, "\n".join(problems)


def test_advertised_addresses_refuse_connections_after_init() -> None:
    results = _rank0(_job())
    not_refused = {name: v for name, v in results["refused"].items() if v != "refused"}
    assert not not_refused, (
        f"advertised addresses not refusing right after init: {not_refused}"
        f" (targets {results['targets']})"
    )


def test_allreduces_stay_exact_while_strangers_connect() -> None:
    outcomes = _job()
    _rank0(outcomes)
    for o in outcomes:
        assert not o.value["errors"], o.value["errors"][:10]
        assert o.value["checked"] > 100, o.value["checked"]


@pytest.mark.parametrize("kind", STRANGERS)
def test_strangers_are_refused_at_connect(kind: str) -> None:
    got = _rank0(_job())["strangers"][kind]
    assert len(got) == 2 * WORLD, got
    through = {name: v for name, v in got.items() if v != "refused"}
    assert not through, f"{kind}: not refused at connect: {through}"


def test_a_connect_close_storm_is_refused() -> None:
    storm = _rank0(_job())["storm"]
    assert storm == {"refused": 200}, f"200 connects: {storm}"


@pytest.mark.parametrize("who", ["wrong_token", "impostor_rank3"])
def test_second_backends_fail_to_join(who: str) -> None:
    ending = _rank0(_job())["second_backends"][who]
    # Its connects are refused: it gives up at its timeout.
    assert ending.startswith("refused") and "Connection refused" in ending, ending


def test_stranger_connections_leave_nothing_behind() -> None:
    outcomes = _job()
    _rank0(outcomes)
    growth = {o.rank: o.value["socket_growth"] for o in outcomes}
    assert all(g <= 0 for g in growth.values()), f"socket descriptors grew: {growth}"
