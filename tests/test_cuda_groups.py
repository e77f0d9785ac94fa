"""Which groups the CUDA path is built from, decided without a GPU.

``fairring_pg.cuda.decision`` decides who runs CUDA collectives (NCCL, or Gloo where ranks of a
host really share its GPUs, hosts told apart as NCCL does: ``NCCL_HOSTID``, else the
hostname) from the facts every rank publishes (CUDA, NCCL, the UUIDs of the GPUs it
sees), so that the choice is the same on every rank whatever ``CUDA_VISIBLE_DEVICES``
each one has; and whether allreduces are composed of sub-groups. ``fairring_pg.cuda.subgroups``
builds the groups: two over the machine's ranks, one per lane over the rail, where
allreduces are sliced at all (FAIRRING_CUDA_ALLREDUCE; by default not with one rank per
machine, nor on one machine: then only the world group). Here the facts are faked and
the groups are recorded instead of made; a job checks the decision on every rank.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from multiprocess import launch, run_ranks

from fairring_pg.config import Config
from fairring_pg.cuda import decision as gpu_decision
from fairring_pg.cuda import job_plan
from fairring_pg.cuda.decision import GpuFacts, decide
from fairring_pg.cuda.subgroups import build_subgroups, cuda_subgroup_kinds
from fairring_pg.model.cuda_plan import plan_allreduce
from fairring_pg.model.nodes import NODE_TYPES
from fairring_pg.topology import build_topology


def topology(rank: int, machines: list[str], nccl_hosts: list[str] | None = None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return build_topology(rank, machines, ["node"] * len(machines), nccl_hosts)


def gpu(i: int) -> str:
    return f"GPU-{i:08x}-0000-0000-0000-000000000000"


def host_of(hosts: int, per_host: int, sees: str) -> list[GpuFacts]:
    """``hosts`` hosts of ``per_host`` ranks with as many GPUs, each rank seeing
    ``sees``: "own" (its GPU only, as CUDA_VISIBLE_DEVICES per task gives), "all"
    (every GPU of its host) or "first" (GPU 0 of its host only: ranks share it)."""
    facts = []
    for h in range(hosts):
        gpus = [gpu(h * per_host + i) for i in range(per_host)]
        for local in range(per_host):
            seen = {"own": [gpus[local]], "all": gpus, "first": gpus[:1]}[sees]
            facts.append(GpuFacts(f"host{h}", True, True, tuple(seen)))
    return facts


@pytest.mark.parametrize("sees", ["own", "all"])
def test_a_gpu_per_rank_is_nccl_whatever_each_rank_sees(sees: str) -> None:
    # 2 hosts of 8 ranks: with CUDA_VISIBLE_DEVICES per task each rank sees 1 GPU,
    # which a count of this process's GPUs took for 8 ranks sharing one.
    decision = decide(host_of(2, 8, sees))
    assert decision.delegate == "nccl" and decision.warning is None, decision


def test_ranks_really_sharing_a_gpu_go_to_gloo_said_once() -> None:
    decision = decide(host_of(2, 2, "first"))
    assert decision.delegate == "gloo", decision
    assert "2 ranks run on host host0 but see 1 GPU(s)" in decision.reason
    assert (
        decision.warning is not None and "NCCL refuses ranks that share a GPU" in decision.warning
    )
    assert decision.warning_rank == 0


def test_one_sharing_host_sends_the_whole_job_to_gloo() -> None:
    facts = host_of(1, 2, "own") + [
        GpuFacts("host1", True, True, (gpu(9),)),
        GpuFacts("host1", True, True, (gpu(9),)),
    ]
    decision = decide(facts)
    assert decision.delegate == "gloo" and "host host1" in decision.reason
    assert decision.warning_rank == 2


def test_simulated_machines_on_one_gpu_use_nccl_with_their_own_hostid() -> None:
    facts = [GpuFacts(f"m{i}", True, True, (gpu(0),)) for i in range(3)]
    assert decide(facts).delegate == "nccl"
    assert cuda_subgroup_kinds(
        topology(1, ["m0", "m1", "m2"], ["m0", "m1", "m2"]), "nccl", False
    ) == (
        "nccl",
        "nccl",
    )


def test_local_gloo_switch_keeps_nccl_rails() -> None:
    ids = ["m0", "m0", "m1", "m1"]  # two ranks per simulated machine on one GPU
    facts = [GpuFacts(ids[r], True, True, (gpu(0),)) for r in range(4)]
    decision = decide(facts)
    assert decision.delegate == "gloo"
    topo = topology(2, ids, ids)
    assert cuda_subgroup_kinds(topo, decision.delegate, True) == ("gloo", "nccl")
    assert cuda_subgroup_kinds(topo, decision.delegate, False) is None


def test_no_gpu_anywhere_or_on_some_ranks_means_no_delegate() -> None:
    assert decide([GpuFacts("a", False, True), GpuFacts("b", False, True)]).delegate == "none"
    facts = host_of(1, 2, "own") + [GpuFacts("cpu-node", False, False)]
    decision = decide(facts)
    assert decision.delegate == "none" and "rank 2 of 3 see no GPU" in decision.reason


def test_nccl_on_some_ranks_only_fails_naming_them() -> None:
    facts = host_of(2, 2, "own")
    facts[3] = GpuFacts("host1", True, False, facts[3].gpus)
    with pytest.raises(
        ValueError, match=r"rank 3 run a torch without NCCL, ranks 0, 1, 2 one with it"
    ):
        decide(facts)


def test_explicit_choices() -> None:
    sharing = host_of(1, 2, "first")
    assert decide(sharing, "nccl").delegate == "nccl"
    assert decide(host_of(1, 2, "own"), "gloo").delegate == "gloo"
    no_nccl = [GpuFacts("a", True, False, (gpu(0),)), GpuFacts("b", True, False, (gpu(1),))]
    assert decide(no_nccl).delegate == "gloo"
    with pytest.raises(
        ValueError, match="FAIRRING_CUDA_DELEGATE=nccl but no rank's torch has NCCL"
    ):
        decide(no_nccl, "nccl")


# ------------------------------------------------- the decision, made by every rank


def decide_with_faked_gpus(rank: int, world: int, facts: list[GpuFacts]) -> str:
    """Create a fairring group with this rank's faked GPU facts and return what it
    decided; NCCL's groups are stood in for by Gloo's (there is no GPU here)."""
    from fairring_pg import group_info, process_groups

    gpu_decision.local_gpu_facts = lambda host: facts[rank]
    process_groups.make_nccl_delegate = _gloo_world
    process_groups.nccl_maker = _gloo_stand_in
    dist.init_process_group("fairring")
    decided = group_info.cuda_decision()
    return f"{decided.delegate}: {decided.reason}"


def _gloo_world(store: Any, rank: int, size: int, timeout: Any, opts: Any) -> Any:
    from fairring_pg.config import Config as Cfg
    from fairring_pg.process_groups import gloo_group

    prefixed = dist.PrefixStore("stand-in-for-nccl/", store)
    return gloo_group(
        prefixed, rank, size, timeout, Cfg.from_env(), list(range(size)), "world", store
    )


def _gloo_stand_in(store: Any, timeout: Any, global_ranks: list[int], max_ctas: int = 0) -> Any:
    from fairring_pg.config import Config as Cfg
    from fairring_pg.process_groups import gloo_maker

    return gloo_maker(store, timeout, Cfg.from_env(), global_ranks)


@pytest.mark.parametrize(
    ("case", "facts", "want"),
    [
        ("one GPU each", host_of(2, 2, "own"), "nccl"),
        ("two ranks on one GPU", host_of(2, 2, "first"), "gloo"),
        ("mixed", host_of(1, 2, "all") + host_of(1, 2, "first")[:1] * 2, "gloo"),
    ],
)
def test_every_rank_decides_alike(case: str, facts: list[GpuFacts], want: str) -> None:
    got = run_ranks(
        decide_with_faked_gpus,
        4,
        ["m0", "m0", "m1", "m1"],
        init_group=False,
        timeout_s=120,
        facts=facts,
    )
    assert len(set(got)) == 1 and got[0].startswith(want + ":"), got


def test_nccl_on_some_ranks_fails_init_on_every_rank() -> None:
    facts = host_of(2, 2, "own")
    facts[1] = GpuFacts("host0", True, False, facts[1].gpus)
    outcomes = launch(
        decide_with_faked_gpus,
        4,
        ["m0", "m0", "m1", "m1"],
        init_group=False,
        timeout_s=120,
        facts=facts,
    )
    for o in outcomes:
        message = o.error_message or ""
        assert o.status == "error" and "rank 1 run a torch without NCCL" in message, o.describe()


@pytest.mark.parametrize(
    ("path", "machines", "rank", "local", "lanes"),
    [
        ("auto", ["m0", "m0", "m1", "m1"], 3, [2, 3], [[1, 3], [1, 3]]),
        ("lanes", ["m0", "m1", "m2"], 1, None, [[0, 1, 2]] * 3),
        ("auto", ["m0", "m1", "m0", "m1"], 2, [0, 2], [[2, 3], [2, 3]]),
        # Nothing but the world group: one rank per machine (the five steps would save no
        # bytes), one machine (no rail), or every allreduce NCCL's own.
        ("auto", ["m0", "m1", "m2"], 1, None, None),
        ("auto", ["m0", "m0", "m0"], 2, None, None),
        ("lanes", ["m0", "m0", "m0"], 2, None, None),
        ("direct", ["m0", "m0", "m1", "m1"], 3, None, None),
    ],
)
def test_groups_and_their_members(
    path: str,
    machines: list[str],
    rank: int,
    local: list[int] | None,
    lanes: list[list[int]] | None,
) -> None:
    made: list[tuple[str, int, int, list[int], str]] = []

    def record(kind: str) -> Any:
        def make(prefix: str, r: int, size: int, members: list[int], name: str) -> Any:
            made.append((prefix, r, size, members, name))
            return f"{kind}:{prefix}"

        return make

    topo = topology(rank, machines)
    lane_count = len(lanes) if lanes else 2
    config = Config(lanes=lane_count, cuda_allreduce=path)
    # Whether the plan composes any call (its rows, from the model, are
    # tests/test_model_gpu.py's).
    node = dataclasses.replace(NODE_TYPES["a100-4x200g"], gpus=topo.local_size)
    M, L = topo.num_machines, topo.local_size
    composes = plan_allreduce(node, M, config, local_size=L, measured=path == "auto").composes
    groups = build_subgroups(
        SimpleNamespace(lanes=[]),
        topo,
        config,
        "WORLD",
        record("local"),
        record("lane"),
        "cuda",
        "7",
        composes,
    )
    assert groups.world == "WORLD"
    if local is None and lanes is None:
        assert made == [] and groups.lanes == [], made
    if local is None:
        assert not hasattr(groups, "local_reduce")
    else:
        assert groups.local_reduce.startswith("local:") and groups.local_gather.startswith("local:")
        for _prefix, r, size, members, _ in made[:2]:
            assert members == local and size == len(local) and r == local.index(rank)
        assert made[0][0] != made[1][0]
    if lanes is None:
        assert groups.lanes == []
    else:
        lane_made = made[-len(lanes) :]
        assert [g.split(":", 1)[0] for g in groups.lanes] == ["lane"] * len(lanes)
        assert len({m[0] for m in lane_made}) == len(lanes)  # a store prefix each
        for (_prefix, r, size, members, _), want in zip(lane_made, lanes, strict=True):
            # The rail: this rank's local rank on every machine, by machine.
            assert members == want and size == len(want) and members[r] == rank
    # Names tell the groups apart, and from another fairring group's (id 7 here).
    names = [m[4] for m in made]
    assert len(set(names)) == len(names) and all("-g7-" in n for n in names), names


# ------------------------------------------------- the CUDA allreduce's plan, job-wide


def plan_of_group(rank: int, world: int) -> str:
    from fairring_pg import group_info

    dist.init_process_group("fairring")
    return group_info.cuda_plan().to_json()


def test_every_rank_runs_rank_zeros_plan_from_the_node_named() -> None:
    """FAIRRING_NODE names the machines; rank 0 plans and every rank runs that plan, the
    one the model gives for those facts at 3 machines x 2 ranks (auto's: the sizes it
    would compose, or is not sure of, measured)."""
    from fairring_pg.cuda import node_facts
    from fairring_pg.model.cuda_plan import CudaPlan, plan_allreduce

    machines = ["m0", "m0", "m1", "m1", "m2", "m2"]
    env = {"FAIRRING_NODE": "h100-2x200g"}
    got = run_ranks(plan_of_group, 6, machines, env=env, init_group=False, timeout_s=120)
    assert len(set(got)) == 1, got
    plan = CudaPlan.from_json(got[0])
    facts = node_facts.from_env(env)
    job = node_facts.merge([facts] * 6, [0, 0, 1, 1, 2, 2])
    want = plan_allreduce(job.gpu_node(2), 3, Config.from_env({}), local_size=2, measured=True)
    assert plan == want
    assert plan.measures, plan.describe()  # this node is worth measuring at 3 machines


def test_a_bad_node_fails_init_on_every_rank() -> None:
    outcomes = launch(
        plan_of_group,
        2,
        ["m0", "m1"],
        rank_env={1: {"FAIRRING_NODE": "a-kind-of-toaster"}},
        init_group=False,
        timeout_s=120,
    )
    for o in outcomes:
        message = o.error_message or ""
        assert o.status == "error" and "FAIRRING_NODE='a-kind-of-toaster'" in message, o.describe()


# ------------------------------------------------ every communicator of a call fits


@pytest.mark.parametrize(
    ("sms", "sharing", "world", "lanes", "local", "want"),
    [
        # One process per GPU, NCCL's 64 CTAs for the world, 2 lanes and 2 local groups.
        (80, 1, 64, 2, 8, 4),  # V100
        (108, 1, 64, 2, 8, 11),  # A100
        (132, 1, 64, 2, 8, 17),  # H100
        (148, 1, 64, 2, 8, 21),  # B200
        (132, 1, 64, 2, 1, 34),  # one rank per machine: the lanes alone
        # Four simulated machines under MPS, NCCL_MAX_NCHANNELS=4: 33 SMs each.
        (132, 4, 4, 2, 1, 14),
        (132, 4, 64, 2, 1, -16),  # the world alone would fill a process's share
    ],
)
def test_sub_group_ctas_leave_room_for_every_communicator(
    sms: int, sharing: int, world: int, lanes: int, local: int, want: int
) -> None:
    ctas = job_plan.co_resident_ctas(sms, sharing, world, lanes, local)
    assert ctas == want
    if ctas >= 1:
        # At one CTA per SM: the world's, and every sub-group's, on the process's share.
        subgroups = lanes + (2 if local > 1 else 0)
        assert world + subgroups * ctas <= sms // sharing < world + subgroups * (ctas + 1)


def test_world_ctas_follow_nccl_limits() -> None:
    assert job_plan.world_ctas({}) == 64
    assert job_plan.world_ctas({"NCCL_MAX_NCHANNELS": "4"}) == 4
    assert job_plan.world_ctas({"NCCL_MAX_CTAS": "16", "NCCL_MAX_NCHANNELS": "32"}) == 16
    assert job_plan.world_ctas({"NCCL_MAX_CTAS": "garbage"}) == 64


def test_processes_per_gpu_counts_ranks_pinned_to_one_gpu() -> None:
    one = GpuFacts("h0", True, True, (gpu(0),), sms=132)
    assert job_plan.processes_per_gpu([one] * 4) == 4  # simulated machines on one GPU
    eight = [GpuFacts("h0", True, True, tuple(gpu(i) for i in range(8)))] * 8
    assert job_plan.processes_per_gpu(eight) == 1  # each sees all eight, uses its own
    own = [GpuFacts("h0", True, True, (gpu(i),)) for i in range(8)]
    assert job_plan.processes_per_gpu(own) == 1


def test_a_plan_whose_communicators_cannot_fit_composes_nothing() -> None:
    from fairring_pg.model.cuda_plan import forced_plan

    config = Config(lanes=2)
    plan = forced_plan("0:compose:2:alltoall", 4, config, 1)
    assert plan.composes
    world = job_plan.world_ctas()  # NCCL_MAX_CTAS / NCCL_MAX_NCHANNELS of this process, or 64
    for sharing in (1, 2, 4, 8):
        facts = [GpuFacts(f"h{i}", True, True, (gpu(0),), sms=132) for i in range(sharing)]
        fitted, ctas = job_plan._fit_on_the_gpu(plan, facts, lanes=2, local_size=1)
        room = job_plan.co_resident_ctas(132, sharing, world, 2, 1)
        assert (fitted.composes, ctas) == ((True, room) if room >= 1 else (False, 0)), sharing
        if room < 1:
            assert "cannot hold" in fitted.rows[0].reason
    # No GPU facts (the test vehicles): no cap, the plan as it was.
    assert job_plan._fit_on_the_gpu(plan, [GpuFacts("h", False, False)] * 4, 2, 1) == (plan, 0)


@pytest.mark.parametrize(
    ("variables", "composes"),
    [
        # NCCL_MAX_CTAS replaces the cap of every sub-group communicator: 32 CTAs for the
        # world and 4 x 32 for the sub-groups are 160 on 132 SMs.
        ({"NCCL_MAX_CTAS": 32}, False),
        # At most 132 // 5 = 26 each: the world and the four sub-groups fit.
        ({"NCCL_MAX_CTAS": 26}, True),
        ({"NCCL_MAX_CTAS": 27}, False),
        # NCCL_MIN_CTAS raises the sub-groups above the cap (17 for an H100 at 2 x 8).
        ({"NCCL_MIN_CTAS": 18}, False),
        ({"NCCL_MIN_CTAS": 16}, True),
        ({"NCCL_MAX_NCHANNELS": 8}, True),
    ],
)
def test_nccl_cta_variables_of_any_rank_cannot_break_co_residency(
    variables: dict[str, int], composes: bool
) -> None:
    """NCCL lets NCCL_MAX_CTAS / NCCL_MIN_CTAS replace a communicator's config.max_ctas
    and min_ctas: the plan counts what NCCL will run on every rank (each rank's variables,
    published with its facts), not the cap it gives, and composes nothing where a rank's
    variables would put more CTAs on the GPU than it has SMs, naming them."""
    from fairring_pg.model.cuda_plan import forced_plan

    plan = forced_plan("0:compose:2:alltoall", 2, Config(lanes=2), 8)
    facts = [GpuFacts(f"h{r // 8}", True, True, (gpu(r),), sms=132) for r in range(16)]
    # Only rank 11 sets them.
    facts[11] = dataclasses.replace(facts[11], nccl_ctas=tuple(variables.items()))
    fitted, ctas = job_plan._fit_on_the_gpu(plan, facts, lanes=2, local_size=8)
    assert fitted.composes == composes, fitted.rows[0].reason
    if composes:
        assert ctas >= 1
        for f in facts:  # each rank's GPU holds its world and four sub-group communicators
            mine = dict(f.nccl_ctas)
            assert job_plan._world_bound(mine) + 4 * job_plan.subgroup_bound(mine, ctas) <= 132
    else:
        reason = fitted.rows[0].reason
        assert ctas == 0 and "rank 11" in reason, reason
        assert all(f"{k}={v}" in reason for k, v in variables.items()), reason


def test_nccl_cta_variables_travel_with_the_facts() -> None:
    from fairring_pg.cuda.decision import nccl_cta_variables

    env = {"NCCL_MAX_CTAS": "16", "NCCL_MIN_CTAS": "x", "NCCL_MIN_NCHANNELS": "0"}
    assert nccl_cta_variables(env) == (("NCCL_MAX_CTAS", 16),)
    assert nccl_cta_variables({}) == ()
