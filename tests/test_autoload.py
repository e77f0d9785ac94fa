"""Registration through torch's ``torch.backends`` entry point, and the extension loader.

The autoload tests run fresh interpreters, because what matters is what ``import torch``
does on its own; they need the package installed (``pip install -e .``) so that the
entry point exists, and skip otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fairring_pg
from fairring_pg import _autoload, _build, _torch_range

REPO = Path(__file__).resolve().parent.parent

needs_entry_point = pytest.mark.skipif(
    not any(ep.name == "fairring" for ep in entry_points(group="torch.backends")),
    reason="fairring_pg is not installed (pip install -e .): no torch.backends entry point",
)


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAIRRING_")}
    full_env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    full_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=Path.home(),  # not the checkout: the package must come from the install
        timeout=timeout,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout.strip().splitlines()[-1]


@needs_entry_point
def test_import_torch_registers_fairring_lazily() -> None:
    out = _python(
        """
        import json, sys, torch
        import torch.distributed as dist
        print(json.dumps({
            "listed": "fairring" in dist.Backend.backend_list,
            "plugin": "FAIRRING" in dist.Backend._plugins,
            "extended": dist.Backend._plugins["FAIRRING"].extended_api,
            "devices": dist.Backend.backend_capability["fairring"],
            "defaults": dist.Backend.default_device_backend_map,
            "heavy": [m for m in ("fairring_pg._build", "fairring_pg.backend",
                                  "torch.utils.cpp_extension") if m in sys.modules],
        }))
        """
    )
    result = json.loads(out)
    assert result["listed"] and result["plugin"] and result["extended"]
    assert result["devices"] == ["cpu", "cuda"]
    # Registering must not take over the default backends of the devices.
    assert result["defaults"]["cpu"] == "gloo"
    assert result["heavy"] == []


@needs_entry_point
def test_autoload_disabled_then_import_registers() -> None:
    out = _python(
        """
        import torch.distributed as dist
        before = "fairring" in dist.Backend.backend_list
        import fairring_pg
        print(before, "fairring" in dist.Backend.backend_list)
        """,
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )
    assert out == "False True"


def test_import_fairring_pg_first() -> None:
    # fairring_pg imports torch, whose autoload re-enters fairring_pg: must not break.
    out = _python(
        """
        import warnings; warnings.simplefilter("error")
        import fairring_pg, torch.distributed as dist
        print("fairring" in dist.Backend.backend_list, fairring_pg.__version__)
        """
    )
    assert out == f"True {fairring_pg.__version__}"


def test_hook_is_cheap() -> None:
    out = _python(
        """
        import sys, time
        t0 = time.perf_counter()
        import torch
        import torch.distributed as dist
        baseline = time.perf_counter() - t0
        t0 = time.perf_counter()
        import fairring_pg
        dt = time.perf_counter() - t0
        assert "fairring" in dist.Backend.backend_list
        print(dt, baseline, "fairring_pg._build" in sys.modules)
        """,
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )
    seconds, baseline, built = out.split()
    assert built == "False"  # neither compiled nor loaded
    # Relative to `import torch` in the same process (a loaded machine slows both):
    # registration is a few small modules, not a second torch (measured: 0.03 s
    # against 1.5 s on 2 idle cores).
    assert float(seconds) < 0.1 * float(baseline), (
        f"registration took {float(seconds):.3f} s, import torch {float(baseline):.3f} s"
    )


def test_register_is_idempotent() -> None:
    before = list(dist.Backend.backend_list)
    _autoload.register()
    fairring_pg.register()
    assert dist.Backend.backend_list == before
    assert dist.Backend.backend_list.count("fairring") == 1


def test_register_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise TypeError("simulated incompatible torch")

    monkeypatch.setattr(dist.Backend, "_plugins", {})
    monkeypatch.setattr(dist.Backend, "register_backend", broken)
    with pytest.warns(RuntimeWarning, match="could not register.*simulated incompatible torch"):
        _autoload.register()


@needs_entry_point
def test_init_process_group_without_importing_fairring_pg(tmp_path: Path) -> None:
    # Two ranks run create_backend end to end; the C++ core is replaced by a stand-in
    # that returns the Gloo delegate, so this checks the Python side only.
    code = f"""
        import datetime, json, sys, torch
        import torch.distributed as dist
        assert "fairring" in dist.Backend.backend_list and "fairring_pg" in sys.modules
        import fairring_pg.backend as backend
        seen = {{}}
        def fake_core(store, rank, size, opts, cpu, cuda):
            seen.update(rank=rank, size=size, machine_of=opts.machine_of,
                        hostnames=len(opts.hostnames), slice=opts.engine.slice_bytes,
                        memory=opts.engine.total_memory, address=opts.engine.listen_address,
                        token=opts.engine.token, timeout=opts.engine.timeout.total_seconds(),
                        cpu=type(cpu).__name__, cuda=cuda is None)
            return cpu
        backend._core_factory = fake_core
        rank = int(sys.argv[1])
        dist.init_process_group("fairring", init_method="file://{tmp_path}/store",
                                rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        dist.barrier()
        seen["sum"] = t.tolist()
        dist.destroy_process_group()
        print(json.dumps(seen))
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAIRRING_")}
    # Scaling off: the test checks that the configured slice reaches the core as is.
    env.update(
        FAIRRING_MACHINE_ID="m",
        FAIRRING_SLICE_SIZE="1M",
        FAIRRING_SLICE_SCALING="off",
        MASTER_ADDR="127.0.0.1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=Path.home(),
        )
        for r in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    for rank, seen in enumerate(results):
        assert seen["rank"] == rank and seen["size"] == 2
        assert seen["machine_of"] == [0, 0] and seen["hostnames"] == 2
        assert seen["slice"] == 1 << 20 and seen["memory"] == 50 << 20
        assert seen["address"] == "127.0.0.1" and seen["timeout"] == 60
        assert seen["cpu"] == "ProcessGroupGloo" and seen["cuda"]
        assert seen["sum"] == [3.0, 3.0, 3.0]
    assert len(results[0]["token"]) == 32 and results[0]["token"] == results[1]["token"]


@needs_entry_point
def test_bad_configuration_fails_init_clearly(tmp_path: Path) -> None:
    code = f"""
        import torch.distributed as dist
        try:
            dist.init_process_group("fairring", init_method="file://{tmp_path}/store",
                                    rank=0, world_size=1)
        except ValueError as exc:
            print(exc)
    """
    out = _python(code, env={"FAIRRING_TOTAL_MEMORY": "lots"})
    assert out.startswith("FAIRRING_TOTAL_MEMORY='lots' is not a byte size")


# ---- the extension loader (no real compile: those are slow) ----------------------------


def test_editable_install_finds_repo_sources() -> None:
    assert REPO / "src" in _build.source_dir_candidates()
    assert Path(fairring_pg.__file__).resolve().parent / "_src" in _build.source_dir_candidates()


def test_no_sources_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"no C\+\+ sources \(\*\.cpp\) found under"):
        _build.load_extension(tmp_path, name="fairring_test_empty")


def test_build_hash_tracks_sources(tmp_path: Path) -> None:
    (tmp_path / "a.cpp").write_text("int a;\n")
    first = _build.build_hash(tmp_path)
    assert _build.build_hash(tmp_path) == first
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.h").write_text("#pragma once\n")
    assert _build.build_hash(tmp_path) != first


def test_build_hash_tracks_where_torch_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A new venv with the same torch: build.ninja names other include paths, so ninja
    # compiles everything again; the hash must differ, or that build would be silent.
    import torch

    (tmp_path / "a.cpp").write_text("int a;\n")
    first = _build.build_hash(tmp_path)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv2" / "torch" / "__init__.py"))
    assert _build.build_hash(tmp_path) != first


def test_compile_error_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "broken.cpp").write_text("int f( { return 0; }\n")
    monkeypatch.setenv("FAIRRING_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.delenv("FAIRRING_BUILD_VERBOSE", raising=False)
    # A torch within the tested range: with a newer one the message ends with a note on
    # that (tests/test_build_progress.py).
    monkeypatch.setattr(torch, "__version__", "{}.{}.0".format(*_torch_range.NEWEST_TESTED))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError) as info:
            _build.load_extension(src, name="fairring_test_broken")
    message = str(info.value)
    assert message.startswith("fairring_pg: building the C++ extension failed")
    assert "broken.cpp" in message and "error" in message
    assert message.endswith("(set FAIRRING_BUILD_VERBOSE=1 to see the whole build output)")
    assert (tmp_path / "build.lock").exists()
