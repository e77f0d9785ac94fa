"""The short multi-rank check that scripts/compat_check.sh runs against the oldest torch
pyproject.toml declares, in a virtual environment of its own: on 2 simulated machines x
2 ranks, allreduce (cut into several slices), reduce-scatter, all-gather and a DDP step,
every result compared exactly with what the ranks' inputs make it.

Not a test module (pytest does not collect it): the suite covers all of this in depth on
the newest torch. Run it as ``python tests/compat_smoke.py``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from multiprocess import SHAPES, fairring_env, run_ranks

MACHINES = SHAPES["2x2"]
# 8 MiB int64 tensors in 512 KiB slices: several slices in flight, bounded by 4 MiB of
# staging, so the pipeline (not only the single-slice path) runs.
ENV = fairring_env(slice_size=512 << 10, total_memory=4 << 20, FAIRRING_SLICE_SCALING="off")
N = 1 << 20


def _wide(rank: int, tag: int, n: int) -> torch.Tensor:
    """Distinct int64 values per (rank, tag), far beyond float32's exact range."""
    return torch.arange(n, dtype=torch.int64) * (rank + 1) + (rank + 7 * tag) * 10**12


def _check(errors: list[str], what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        bad = (got != want).nonzero()[:1].flatten().tolist() if got.shape == want.shape else []
        errors.append(f"{what}: got {got.dtype} {tuple(got.shape)}, wrong at {bad}")


# torch 2.13 renamed the tensor forms (the old names warn from then on); 2.11 has only
# the old ones.
def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: dist.ReduceOp) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=op)


def _all_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


def smoke(rank: int, world: int) -> list[str]:
    errors: list[str] = []
    if dist.get_backend() != "fairring":
        return [f"the default group runs {dist.get_backend()}, not fairring"]

    t = _wide(rank, 1, N)
    dist.all_reduce(t)
    _check(errors, "allreduce SUM int64", t, sum(_wide(r, 1, N) for r in range(world)))
    t = (torch.arange(N) % 1009 - 500).float() * (1 - 2 * (rank % 2)) + rank
    want = torch.stack(
        [(torch.arange(N) % 1009 - 500).float() * (1 - 2 * (r % 2)) + r for r in range(world)]
    ).amax(0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    _check(errors, "allreduce MAX float32", t, want)

    n = 3001  # not a multiple of the ranks per machine or of anything else
    inp = torch.cat([_wide(rank, 10 + j, n) for j in range(world)])
    out = torch.empty(n, dtype=torch.int64)
    _reduce_scatter(out, inp, dist.ReduceOp.SUM)
    _check(errors, "reduce-scatter SUM", out, sum(_wide(r, 10 + rank, n) for r in range(world)))

    out = torch.empty(world * n, dtype=torch.int64)
    _all_gather(out, _wide(rank, 20, n))
    _check(errors, "all-gather", out, torch.cat([_wide(r, 20, n) for r in range(world)]))

    errors += _ddp_step(rank, world)
    return errors


def _ddp_step(rank: int, world: int) -> list[str]:
    """One SGD step of a bias-free linear layer on small integers: every number on the
    way (gradients, their average over 4 ranks, lr 1/4) is exact in float32."""
    errors: list[str] = []
    model = torch.nn.Linear(8, 4, bias=False)
    start = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    with torch.no_grad():
        model.weight.copy_(start + 100 * rank)  # DDP must broadcast rank 0's
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    _check(errors, "DDP's initial broadcast", model.weight.detach(), start)

    def batch(r: int) -> torch.Tensor:
        return torch.arange(24, dtype=torch.float32).reshape(3, 8) % 5 + r

    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.25)
    ddp(batch(rank)).sum().backward()
    optimizer.step()
    # d(sum of outputs)/dW[i, j] = sum over the batch of x[:, j], for every row i.
    mean_grad = sum(batch(r).sum(0) for r in range(world)) / world
    want = start - 0.25 * mean_grad.expand(4, 8)
    _check(errors, "DDP step (weights after one SGD step)", model.weight.detach(), want)
    return errors


def main() -> int:
    from compat_smoke import smoke  # the ranks import it by this name, not as __main__

    import fairring_pg

    where = f"torch {torch.__version__}, fairring_pg from {fairring_pg.__file__}"
    results = run_ranks(smoke, len(MACHINES), MACHINES, "fairring", ENV, timeout_s=300)
    problems = [f"rank {r}: {e}" for r, errors in enumerate(results) for e in errors]
    if problems:
        print(f"compat smoke FAILED ({where}):\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(
        f"compat smoke passed ({where}): allreduce, reduce-scatter, all-gather and a DDP"
        " step exact on 2 machines x 2 ranks"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
