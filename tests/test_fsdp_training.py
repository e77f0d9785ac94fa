"""FSDP2 (``fully_shard`` per Transformer block) trains the same on fairring as on Gloo.

One 2x2 job (simulated machines, CPU): every rank builds the same small Transformer
twice from one seed, shards one copy over the fairring group (the default group) and
one over a Gloo group, and trains both on the same batches with SGD. FSDP2 all-gathers
each block's parameters before its forward and backward and reduce-scatters (AVG) its
gradients after: on fairring those run on fairring's engine, which the job proves from
its Timeline (one "reduce_scatter #" / "all_gather #" event per engine operation, none
of them allreduces) — a delegation to Gloo would leave no such events.

Why the tolerance: an all-gather moves bytes and is exact; a reduce-scatter sums four
float32 values, and fairring (this machine's ranks first, then the other machine's
partial) and Gloo (an allreduce of its own order) may round the sum differently, by an
ulp of the gradient (~6e-8 relative). SGD turns that into a parameter difference of
about lr x |grad| x 6e-8 per step, and a handful of steps does not amplify it much.
So the weights must agree to 1e-5 (absolute, on weights of order 0.1-1; the
losses to 1e-5 relative), and they must have moved from their initial values by far
more than that (1000x), so that "equal" is not "untrained". Measured: 1.2e-7 apart
after moving 0.038.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from multiprocess import SHAPES, fairring_env, run_ranks

from fairring_pg.tools.timeline_command import load_trace

STEPS = 6
LR = 0.5
TOLERANCE = 1e-5


def _train(rank: int, world: int) -> dict[str, Any]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformer import ModelConfig, SyntheticCorpus, build_model

    cfg = ModelConfig(vocab=512, d_model=64, heads=4, layers=2, ff=128, seq_len=16)
    groups = {"fairring": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    initial = {k: v.clone() for k, v in build_model(cfg, seed=0).state_dict().items()}
    results: dict[str, Any] = {}
    for name, group in groups.items():
        model = build_model(cfg, seed=0)
        mesh = DeviceMesh.from_group(group, "cpu")
        for block in model.encoder.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        corpus = SyntheticCorpus(cfg.vocab, seed=0, rank=rank)
        losses = []
        for _ in range(STEPS):
            inputs, targets = corpus.batch(4, cfg.seq_len)
            loss = F.cross_entropy(model(inputs).reshape(-1, cfg.vocab), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        results[name] = (full, losses)
    (a, loss_a), (b, loss_b) = results["fairring"], results["gloo"]
    return {
        "max_diff": max((a[k] - b[k]).abs().max().item() for k in a),
        "max_moved": max((a[k] - initial[k]).abs().max().item() for k in a),
        "losses": (loss_a, loss_b),
    }


def test_fsdp2_trains_the_same_on_fairring_as_on_gloo(tmp_path: Path) -> None:
    env = fairring_env(FAIRRING_TIMELINE=str(tmp_path / "trace.json"))
    results = run_ranks(_train, 4, SHAPES["2x2"], env=env, timeout_s=240)
    for rank, r in enumerate(results):
        assert r["max_diff"] <= TOLERANCE, (rank, r["max_diff"])
        assert r["max_moved"] > 1000 * TOLERANCE, (rank, r["max_moved"])
        for fa, gl in zip(*r["losses"], strict=True):
            assert abs(fa - gl) <= TOLERANCE * abs(gl), (rank, r["losses"])

    for rank in range(4):
        events = load_trace(tmp_path / f"trace.rank{rank}.json")
        names = [e["name"].split(" #")[0] for e in events if e.get("cat") == "ops"]
        # Per step: an all-gather per block and one for the root in forward, again
        # in backward for what was resharded, and a reduce-scatter per FSDP unit.
        assert names.count("reduce_scatter") >= 3 * STEPS, names
        assert names.count("all_gather") >= 3 * STEPS, names
