"""FAIRRING_* parsing and validation, the staging-slot bound and the cross-rank check."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from fairring_pg import config as config_mod
from fairring_pg.config import (
    DEFAULT_SLICE_SIZE,
    DEFAULT_TOTAL_MEMORY,
    GIB,
    KIB,
    MIB,
    TIB,
    Config,
    parse_byte_size,
)
from fairring_pg.network import listen_address
from fairring_pg.sizing import staging_slot_bytes

SIZE_VARS = ["FAIRRING_SLICE_SIZE", "FAIRRING_TOTAL_MEMORY", "FAIRRING_PIPELINE_CHUNK"]


def test_defaults() -> None:
    cfg = Config.from_env({})
    assert cfg == Config(
        slice_size=DEFAULT_SLICE_SIZE,
        total_memory=DEFAULT_TOTAL_MEMORY,
        machine_id=None,
        socket_ifname=None,
        slice_scaling=True,
        timeline=None,
        cuda_delegate="auto",
        node="detect",
        build_dir=None,
        build_verbose=False,
    )
    assert cfg.slice_size == 25 * MIB and cfg.total_memory == 50 * MIB
    assert cfg.pipeline_chunk == MIB


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", 1),
        ("1048576", MIB),
        ("25M", 25 * MIB),
        ("25MiB", 25 * MIB),
        ("25mib", 25 * MIB),
        ("25MB", 25 * MIB),
        ("25 M", 25 * MIB),
        (" 25M ", 25 * MIB),
        ("512k", 512 * KIB),
        ("512KiB", 512 * KIB),
        ("1G", GIB),
        ("1gb", GIB),
        ("1024G", TIB),
        ("64B", 64),
        ("1.5K", 1536),
        ("0.5M", MIB // 2),
    ],
)
@pytest.mark.parametrize("var", SIZE_VARS)
def test_byte_sizes_accepted(var: str, raw: str, expected: int) -> None:
    cfg = Config.from_env({var: raw})
    assert getattr(cfg, var.removeprefix("FAIRRING_").lower()) == expected


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("abc", "is not a byte size"),
        ("", "is not a byte size"),
        ("   ", "is not a byte size"),
        ("25X", "is not a byte size"),
        ("25MM", "is not a byte size"),
        ("M", "is not a byte size"),
        ("1e6", "is not a byte size"),
        ("0x10", "is not a byte size"),
        ("1iB", "is not a byte size"),
        ("25T", "is not a byte size"),
        ("-1", "must be positive"),
        ("-25M", "must be positive"),
        ("0", "must be positive"),
        ("0M", "must be positive"),
        ("1.5", "not a whole number of bytes"),
        ("0.3K", "not a whole number of bytes"),
        ("1025G", "larger than the accepted maximum"),
        (str(TIB + 1), "larger than the accepted maximum"),
        ("99999999999999999999999", "larger than the accepted maximum"),
    ],
)
@pytest.mark.parametrize("var", SIZE_VARS)
def test_byte_sizes_rejected(var: str, raw: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        Config.from_env({var: raw})
    message = str(info.value)
    assert message.startswith(f"{var}={raw!r} ")
    assert why in message
    assert "K/M/G" in message or "1 TiB" in message


def test_error_message_shape() -> None:
    with pytest.raises(ValueError, match=r"^FAIRRING_SLICE_SIZE='abc' is not a byte size: "):
        Config.from_env({"FAIRRING_SLICE_SIZE": "abc"})


@given(st.integers(min_value=1, max_value=TIB))
def test_plain_integers_round_trip(n: int) -> None:
    assert parse_byte_size("X", str(n)) == n


@given(st.integers(min_value=1, max_value=1024), st.sampled_from(["K", "M", "G"]))
def test_suffixes_are_powers_of_1024(n: int, suffix: str) -> None:
    scale = {"K": KIB, "M": MIB, "G": GIB}[suffix]
    for spelling in (suffix, suffix.lower(), suffix + "B", suffix + "iB", suffix.lower() + "ib"):
        assert parse_byte_size("X", f"{n}{spelling}") == n * scale


def test_machine_id() -> None:
    assert Config.from_env({"FAIRRING_MACHINE_ID": " node-7 "}).machine_id == "node-7"
    for raw in ["", "   ", "\t"]:
        with pytest.raises(ValueError, match=r"FAIRRING_MACHINE_ID=.* is empty: expected"):
            Config.from_env({"FAIRRING_MACHINE_ID": raw})


def test_slice_scaling() -> None:
    assert Config.from_env({}).slice_scaling is True
    assert Config.from_env({"FAIRRING_SLICE_SCALING": "on"}).slice_scaling is True
    assert Config.from_env({"FAIRRING_SLICE_SCALING": "OFF"}).slice_scaling is False
    for raw in ["yes", "1", "", "true"]:
        with pytest.raises(ValueError, match=r"FAIRRING_SLICE_SCALING=.* expected 'on' or 'off'"):
            Config.from_env({"FAIRRING_SLICE_SCALING": raw})


def test_socket_ifname_loopback() -> None:
    cfg = Config.from_env({"TP_SOCKET_IFNAME": "lo"})
    assert cfg.socket_ifname == "lo"
    assert listen_address(cfg, environ={}) == "127.0.0.1"


def test_socket_ifname_unknown() -> None:
    with pytest.raises(ValueError) as info:
        Config.from_env({"TP_SOCKET_IFNAME": "nosuchif0"})
    assert "TP_SOCKET_IFNAME='nosuchif0' is not a network interface" in str(info.value)
    assert "lo" in str(info.value)  # names the interfaces that do exist
    with pytest.raises(ValueError, match="TP_SOCKET_IFNAME='' is empty"):
        Config.from_env({"TP_SOCKET_IFNAME": ""})


def test_socket_ifname_without_ipv4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_mod, "interface_names", lambda: ["lo", "eth9"])
    monkeypatch.setattr(config_mod, "interface_ipv4", lambda name: None)
    with pytest.raises(ValueError, match="TP_SOCKET_IFNAME='eth9' has no IPv4 address"):
        Config.from_env({"TP_SOCKET_IFNAME": "eth9"})


def test_listen_address_from_master_addr() -> None:
    cfg = Config.from_env({})
    assert listen_address(cfg, environ={}) == "127.0.0.1"
    assert listen_address(cfg, environ={"MASTER_ADDR": "localhost"}) == "127.0.0.1"
    assert listen_address(cfg, environ={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) == (
        "127.0.0.1"
    )
    with pytest.raises(ValueError, match="MASTER_ADDR='no-such-host.invalid'"):
        listen_address(cfg, environ={"MASTER_ADDR": "no-such-host.invalid"})


# ---- staging slot bound ---------------------------------------------------------------


def test_staging_slot_formula() -> None:
    assert staging_slot_bytes(25 * MIB, 1, 1) == 0
    # L=1: only the rail part, (M-1) shards of S/M plus a 16-byte header, 64-aligned.
    assert staging_slot_bytes(1000, 2, 1) == 576  # ceil(500 + 16) = 516 -> 576
    # M=1: only the intra-node part, (L-1) chunks of S/L plus 8 bytes.
    assert staging_slot_bytes(1000, 1, 4) == 832  # 3 * ceil(250 + 8) = 774 -> 832
    assert staging_slot_bytes(64, 2, 2) == 128  # ceil(32 + 8) + ceil(16 + 16) = 72 -> 128


def test_staging_slot_formula_by_hand() -> None:
    def reference(s: int, m: int, loc: int) -> int:
        import math

        total = (loc - 1) * math.ceil(s / loc + 8) + (m - 1) * math.ceil(s / (loc * m) + 16)
        return math.ceil(total / 64) * 64

    for s in [1, 7, 64, 1000, 25 * MIB, 25 * MIB + 3]:
        for m in [1, 2, 3, 8]:
            for loc in [1, 2, 3, 8]:
                assert staging_slot_bytes(s, m, loc) == reference(s, m, loc)


def test_staging_check() -> None:
    Config(total_memory=1).check_staging_fits(1, 1)  # a 0-byte slot always fits
    need = staging_slot_bytes(25 * MIB, 2, 2)
    Config(total_memory=need).check_staging_fits(2, 2)
    with pytest.raises(ValueError) as info:
        Config(total_memory=need - 1).check_staging_fits(2, 2)
    message = str(info.value)
    assert f"FAIRRING_TOTAL_MEMORY={need - 1}" in message
    assert f"FAIRRING_SLICE_SIZE={25 * MIB}" in message
    assert f">= {need}" in message


# ---- consistency across ranks ---------------------------------------------------------


def _run_ranks(configs: list[Config]) -> list[BaseException | None]:
    store = dist.HashStore()
    results: list[BaseException | None] = [None] * len(configs)

    def rank_main(rank: int) -> None:
        try:
            configs[rank].check_consistent_across_ranks(
                store, rank, len(configs), timedelta(seconds=10)
            )
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(configs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_consistent_across_ranks() -> None:
    # Machine ids and interfaces differ per machine by design; they are not compared.
    configs = [Config(machine_id=f"m{r}") for r in range(4)]
    assert _run_ranks(configs) == [None] * 4
    assert _run_ranks([Config()]) == [None]


@pytest.mark.parametrize(
    ("field", "value", "var", "shown"),
    [
        ("slice_size", 4 * MIB, "FAIRRING_SLICE_SIZE", str(4 * MIB)),
        ("total_memory", 8 * MIB, "FAIRRING_TOTAL_MEMORY", str(8 * MIB)),
        ("slice_scaling", False, "FAIRRING_SLICE_SCALING", "'off'"),
        ("pipeline_chunk", 64 * KIB, "FAIRRING_PIPELINE_CHUNK", str(64 * KIB)),
        ("lanes", 3, "FAIRRING_LANES", "3"),
        # Ranks that disagree on these take different paths (direct or five steps, the
        # sub-group path or not, local Gloo or not) and pair mismatched collectives.
        ("direct_below", 0, "FAIRRING_DIRECT_BELOW", "0"),
        ("cuda_allreduce", "lanes", "FAIRRING_CUDA_ALLREDUCE", "'lanes'"),
        ("cpu_allreduce", "engine", "FAIRRING_CPU_ALLREDUCE", "'engine'"),
        ("test_cpu_subgroups", True, "FAIRRING_TEST_CPU_SUBGROUPS", "'on'"),
        ("test_local_gloo", True, "FAIRRING_TEST_LOCAL_GLOO", "'on'"),
    ],
)
def test_mismatch_across_ranks(field: str, value: Any, var: str, shown: str) -> None:
    configs = [Config() for _ in range(3)]
    configs[2] = Config(**{field: value})
    results = _run_ranks(configs)
    assert results[1] is None
    for rank in (0, 2):
        assert isinstance(results[rank], ValueError)
    bad = str(results[2])
    assert bad.startswith(f"{var} differs across ranks: rank 2 has {shown}, rank 0 has ")
    # Rank 0 fails too (naming the odd rank), rather than timing out later.
    assert f"rank 2 has {shown}" in str(results[0])


def test_effective_slice_size_grows_against_over_sharding() -> None:
    # 1 MiB slices on 8 machines x 1 rank would make 128 KiB shards: grown to 8 MiB.
    config = Config(slice_size=1 * MIB, total_memory=64 * MIB)
    assert config.effective_slice_size(8, 1) == 8 * MIB
    assert staging_slot_bytes(8 * MIB, 8, 1) * 2 <= 64 * MIB
    # Shards already >= 1 MiB: unchanged.
    assert config.effective_slice_size(1, 1) == 1 * MIB
    assert Config().effective_slice_size(4, 2) == Config().slice_size
    # Off: never changed.
    assert Config(slice_size=1 * MIB, slice_scaling=False).effective_slice_size(8, 1) == 1 * MIB


def test_effective_slice_size_keeps_two_slots_in_staging() -> None:
    config = Config(slice_size=1 * MIB, total_memory=6 * MIB)
    grown = config.effective_slice_size(8, 1)
    assert 1 * MIB < grown < 8 * MIB
    assert 2 * staging_slot_bytes(grown, 8, 1) <= 6 * MIB
    # Staging too small to grow at all: the configured slice stays.
    tight = Config(slice_size=1 * MIB, total_memory=2 * MIB)
    assert tight.effective_slice_size(8, 1) == 1 * MIB


def test_timeline(tmp_path: Any) -> None:
    path = str(tmp_path / "trace.json")
    config = Config.from_env({"FAIRRING_TIMELINE": path})
    assert config.timeline_path(3) == str(tmp_path / "trace.rank3.json")
    templated = Config.from_env({"FAIRRING_TIMELINE": str(tmp_path / "t-{rank}.json")})
    assert templated.timeline_path(1) == str(tmp_path / "t-1.json")
    assert Config.from_env({}).timeline_path(0) == ""
    with pytest.raises(ValueError, match=r"FAIRRING_TIMELINE=.*does not exist"):
        Config.from_env({"FAIRRING_TIMELINE": str(tmp_path / "missing" / "t.json")})
    with pytest.raises(ValueError, match=r"FAIRRING_TIMELINE"):
        Config.from_env({"FAIRRING_TIMELINE": "  "})


def test_cuda_delegate() -> None:
    assert Config.from_env({}).cuda_delegate == "auto"
    assert Config.from_env({"FAIRRING_CUDA_DELEGATE": " Gloo "}).cuda_delegate == "gloo"
    for raw in ("", "mpi", "ncclx"):
        with pytest.raises(ValueError, match=r"FAIRRING_CUDA_DELEGATE=.*expected one of auto"):
            Config.from_env({"FAIRRING_CUDA_DELEGATE": raw})


def test_cpu_allreduce() -> None:
    assert Config.from_env({"FAIRRING_CPU_ALLREDUCE": " Engine "}).cpu_allreduce == "engine"
    for raw in ("ring", "", "nccl"):
        with pytest.raises(ValueError, match=r"FAIRRING_CPU_ALLREDUCE=.*expected one of auto"):
            Config.from_env({"FAIRRING_CPU_ALLREDUCE": raw})
    # Gloo's ring only where the engine saves no bytes: one rank per machine.
    auto, engine, gloo = (Config(cpu_allreduce=v) for v in ("auto", "engine", "gloo"))
    assert [auto.cpu_ring_from(m, 1) for m in (1, 2, 8)] == [-1, MIB, MIB]
    assert [auto.cpu_ring_from(2, local) for local in (2, 8)] == [-1, -1]
    assert engine.cpu_ring_from(4, 1) == -1
    assert gloo.cpu_ring_from(2, 2) == 0
