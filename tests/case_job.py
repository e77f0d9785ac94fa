"""Many checks in one multi-process job (``CaseJob``): each rank runs every case of a
list in one process group, and each case is then one test that fails with the errors
of every rank. The launcher is multiprocess.run_ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from multiprocess import DEFAULT_BACKEND, RankFailure, run_ranks


def _run_case_list(
    rank: int,
    world_size: int,
    runner: Callable[[int, int, Any], str | None],
    cases: Sequence[Any],
) -> dict[str, str | None]:
    """Rank side of a CaseJob: run every case in order, report each one's error."""
    results: dict[str, str | None] = {}
    for case in cases:
        print(f"case {case.id} at {time.time():.2f}", flush=True)  # in the log, if it hangs
        try:
            results[case.id] = runner(rank, world_size, case)
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[case.id] = f"{type(exc).__name__}: {exc}"
    return results


class CaseJob:
    """Many checks in one process group: each rank runs ``runner(rank, world_size,
    case)`` for every case (same order on all ranks); the runner returns None if the
    case passed, else what went wrong, and an exception fails only its case. Cases
    need a unique ``id`` and must pickle. The job runs once, on the first ``check``;
    ``check(case_id)`` then fails the calling test with the errors of every rank."""

    def __init__(
        self,
        name: str,
        runner: Callable[[int, int, Any], str | None],
        cases: Sequence[Any],
        machine_ids: Sequence[str],
        backend: str | None = None,
        env: Mapping[str, str | int | None] | None = None,
        timeout_s: float = 300,
        pg_timeout_s: float | None = None,
    ) -> None:
        ids = [c.id for c in cases]
        if len(ids) != len(set(ids)):
            raise ValueError(f"{name}: case ids are not unique")
        self.name = name
        self.runner = runner
        self.cases = list(cases)
        self.machine_ids = list(machine_ids)
        self.backend = DEFAULT_BACKEND if backend is None else backend
        self.env = env
        self.timeout_s = timeout_s
        self.pg_timeout_s = pg_timeout_s
        self._errors: dict[str, list[tuple[int, str]]] | None = None
        self._failure: RankFailure | None = None
        self._failure_shown = False

    @property
    def case_ids(self) -> list[str]:
        return [c.id for c in self.cases]

    def _run(self) -> None:
        if self._errors is not None or self._failure is not None:
            return
        try:
            per_rank = run_ranks(
                _run_case_list,
                len(self.machine_ids),
                self.machine_ids,
                backend=self.backend,
                env=self.env,
                timeout_s=self.timeout_s,
                pg_timeout_s=self.pg_timeout_s,
                runner=self.runner,
                cases=self.cases,
            )
        except RankFailure as exc:
            self._failure = exc
            return
        errors: dict[str, list[tuple[int, str]]] = {i: [] for i in self.case_ids}
        for rank, results in enumerate(per_rank):
            for case_id in errors:
                if case_id not in results:
                    errors[case_id].append((rank, "no result from this rank"))
                elif results[case_id] is not None:
                    errors[case_id].append((rank, results[case_id]))
        self._errors = errors

    def errors(self) -> dict[str, list[tuple[int, str]]]:
        """Case id -> [(rank, error)] (empty if the case passed on every rank); runs the
        job if it has not run. Raises RankFailure if the job as a whole failed."""
        self._run()
        if self._failure is not None:
            raise self._failure
        assert self._errors is not None
        return self._errors

    def check(self, case_id: str) -> None:
        import pytest

        self._run()
        if self._failure is not None:
            if self._failure_shown:
                first = str(self._failure).splitlines()[0]
                pytest.fail(f"the {self.name} job failed (its first case shows why): {first}")
            self._failure_shown = True
            pytest.fail(f"the {self.name} job failed:\n{self._failure}")
        assert self._errors is not None
        errors = self._errors[case_id]
        if errors:
            pytest.fail(
                f"{case_id} on {self.backend} {self.machine_ids}:\n"
                + "\n".join(f"  rank {rank}: {err}" for rank, err in errors)
            )
