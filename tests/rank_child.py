"""A rank's side of the multi-process harness (multiprocess.launch): ``python
rank_child.py JOB_DIR RANK``, or forked from the zygote (``python rank_child.py
--zygote``, tests/rank_zygote.py). It reads the job's spec, creates the process group
(unless the job asks for none), runs the job's function and leaves its result, or
its error, in the job's folder for the parent; its phase file says how far it got.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _start_together(store: Any, world_size: int) -> None:
    """Wait until every rank has imported torch (seconds apart on a loaded machine), so
    that a short group timeout bounds what the test is about, not the start-up."""
    if store.add("fairring_test/started", 1) == world_size:
        store.set("fairring_test/go", b"1")
    store.wait(["fairring_test/go"])


def child_main(job_dir: Path, rank: int) -> int:
    import faulthandler

    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def phase(name: str) -> None:
        _write_atomic(job_dir / f"rank{rank}.phase", name.encode())

    spec: dict[str, Any] = pickle.loads((job_dir / "spec.pkl").read_bytes())
    for entry in reversed(spec["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    result_path = job_dir / f"rank{rank}.result"
    try:
        phase("import")
        import torch.distributed as dist

        if spec["backend"] == "fairring" and not spec["bare"]:
            import fairring_pg  # noqa: F401 - registers the backend

        fn = pickle.loads(spec["fn"])
        kwargs = pickle.loads(spec["kwargs"])
        phase("init")
        timeout = timedelta(seconds=spec["pg_timeout_s"])
        if spec["bare"]:
            store = dist.TCPStore("127.0.0.1", spec["store_port"], is_master=False, timeout=timeout)
            phase("fn")
            value = fn(rank, spec["world_size"], store, **kwargs)
            _write_atomic(result_path, pickle.dumps(("ok", value)))
            phase("exit")
            print("fn returned; exiting", flush=True)
            return 0
        if spec["init_group"]:
            store = dist.TCPStore(
                "127.0.0.1", spec["store_port"], is_master=False, timeout=timedelta(seconds=600)
            )
            _start_together(store, spec["world_size"])
            store.set_timeout(timeout)
            dist.init_process_group(
                spec["backend"],
                store=store,
                rank=rank,
                world_size=spec["world_size"],
                timeout=timeout,
            )
        phase("fn")
        value = fn(rank, spec["world_size"], **kwargs)
        payload = pickle.dumps(("ok", value))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        try:
            exc_bytes: bytes | None = pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            exc_bytes = None
        payload = pickle.dumps(
            ("error", (type(exc).__qualname__, str(exc), tb, exc_bytes, time.time()))
        )
        _write_atomic(result_path, payload)
        return 1
    _write_atomic(result_path, payload)
    phase("destroy")
    if dist.is_initialized():
        dist.destroy_process_group()
    phase("exit")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        import rank_zygote

        sys.exit(child_main(*rank_zygote.serve()))
    sys.exit(child_main(Path(sys.argv[1]), int(sys.argv[2])))
