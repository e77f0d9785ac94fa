"""What the first-use compile shows: one process reports (what, where, how long, that the
others wait, a line every few seconds, a line when done); a load from the cache is
silent. The real compiles here build a tiny extension, not fairring's core: seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fairring_pg import _build, _build_progress, _torch_range

# A module written against Python's C API alone: it compiles in about a second.
TINY_SOURCE = """
#include <Python.h>

static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ANSWER); }

static PyMethodDef methods[] = {
    {"answer", answer, METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr},
};
static PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "NAME", nullptr, -1, methods, nullptr, nullptr, nullptr, nullptr,
};

PyMODINIT_FUNC PyInit_NAME() { return PyModule_Create(&module_def); }
"""

LOAD = """
import sys
import torch
from fairring_pg import _build
torch.__version__ = sys.argv[3]  # the torch version the build is told it has
print(_build.load_extension(sys.argv[1], name=sys.argv[2]).answer())
"""


# What the loads below report for a torch within the tested range: with a newer one (what
# pip may install), the first line would say so (that has a test of its own, below).
TESTED_TORCH = "{}.{}.0".format(*_torch_range.NEWEST_TESTED)


def _tiny_extension(src: Path, name: str, answer: int) -> None:
    src.mkdir(exist_ok=True)
    text = TINY_SOURCE.replace("NAME", name).replace("ANSWER", str(answer))
    (src / "tiny.cpp").write_text(text)


def _start_load(
    src: Path, name: str, build_dir: Path, torch_version: str = TESTED_TORCH
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAIRRING_")}
    env.pop("RANK", None)
    env["FAIRRING_BUILD_DIR"] = str(build_dir)
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LOAD), str(src), name, torch_version],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    return out.strip(), err


def test_progress_names_the_build_ticks_and_closes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    with _build_progress.compile_progress("fairring_pg_C", tmp_path, 21, interval=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (
        f"fairring_pg (rank 3): compiling the C++ core (fairring_pg_C, 21 source files)"
        f" into {tmp_path}; the other ranks on this machine wait for it"
    )
    assert lines[1].startswith("fairring_pg (rank 3): this happens once per machine")
    assert "2 CPU-minutes" in lines[1] and "FAIRRING_BUILD_VERBOSE=1" in lines[1]
    ticks = lines[2:-1]
    assert len(ticks) >= 3, lines
    assert all(t.startswith("fairring_pg (rank 3): still compiling the C++ core (") for t in ticks)
    assert lines[-1] == (
        f"fairring_pg (rank 3): compiled the C++ core in 0 s; later runs load it from {tmp_path}"
    )


def test_progress_says_when_the_compile_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="compiler exploded"):
        with _build_progress.compile_progress("x", tmp_path, 1, interval=60):
            raise RuntimeError("compiler exploded")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("fairring_pg: compiling the C++ core (x, 1 source file) into")
    assert lines[2] == "fairring_pg: compiling the C++ core failed after 0 s"


def test_one_process_reports_the_build_and_a_cached_load_is_silent(tmp_path: Path) -> None:
    src, build_dir, name = tmp_path / "src", tmp_path / "build", "fairring_test_tiny"
    _tiny_extension(src, name, answer=41)

    # Three processes of one machine start together: one compiles and says so, the
    # others wait on the build lock and then load the result without a word.
    procs = [_start_load(src, name, build_dir) for _ in range(3)]
    results = [_finish(p) for p in procs]
    assert [out for out, _ in results] == ["41"] * 3
    # A waiter past PROGRESS_INTERVAL_S (a loaded machine) says only that it waits.
    reporters = [err for _, err in results if _without_waiting(err)]
    assert len(reporters) == 1, [err for _, err in results]
    lines = reporters[0].splitlines()
    assert lines[0] == (
        f"fairring_pg: compiling the C++ core ({name}, 1 source file) into {build_dir};"
        " the other ranks on this machine wait for it"
    )
    assert len(lines) >= 3 and lines[1].startswith("fairring_pg: this happens once")
    assert lines[-1].startswith("fairring_pg: compiled the C++ core in ")
    assert lines[-1].endswith(f" s; later runs load it from {build_dir}")

    assert _finish(_start_load(src, name, build_dir)) == ("41", "")

    # FAIRRING_BUILD_DIR is not keyed by the sources: a changed source in the same
    # directory is compiled again, and reported again.
    _tiny_extension(src, name, answer=43)
    out, err = _finish(_start_load(src, name, build_dir))
    assert out == "43"
    assert err.startswith("fairring_pg: compiling the C++ core") and "compiled the C++" in err


WAITING = "fairring_pg: waiting for another process to finish compiling the C++ core ("


def _without_waiting(err: str) -> str:
    return "\n".join(line for line in err.splitlines() if not line.startswith(WAITING))


@pytest.mark.parametrize("value", ["yes", "true", "2", "on"])
def test_a_bad_verbose_setting_fails_before_building(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tiny_extension(tmp_path / "src", "fairring_test_unbuilt", answer=1)
    monkeypatch.setenv("FAIRRING_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.setenv("FAIRRING_BUILD_VERBOSE", value)
    with pytest.raises(ValueError) as info:
        _build.load_extension(tmp_path / "src", name="fairring_test_unbuilt")
    assert str(info.value) == (
        f"FAIRRING_BUILD_VERBOSE={value!r} is not valid: expected 1 (show the compiler's"
        " output) or 0 (the default)"
    )
    assert not (tmp_path / "build").exists()


def test_a_torch_older_than_supported_is_refused_before_compiling(tmp_path: Path) -> None:
    src, build_dir, name = tmp_path / "src", tmp_path / "build", "fairring_test_old_torch"
    _tiny_extension(src, name, answer=7)
    proc = _start_load(src, name, build_dir, torch_version="2.10.2+cpu")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and out == ""
    # One message (the traceback's last line), and no compile started.
    assert err.splitlines()[-1] == (
        "RuntimeError: fairring_pg needs torch >= 2.11 (tested: 2.11 to 2.15), found torch"
        " 2.10.2+cpu: its C++ core does not compile against this torch. Upgrade torch"
        " (pip install 'torch>=2.11,<2.16'), then run again."
    )
    assert "compiling" not in err
    assert not build_dir.exists()


def test_a_newer_torch_than_tested_is_tried_with_one_line_saying_so(tmp_path: Path) -> None:
    src, build_dir, name = tmp_path / "src", tmp_path / "build", "fairring_test_new_torch"
    _tiny_extension(src, name, answer=11)
    note = (
        "fairring_pg: torch 2.99.0 is newer than the releases fairring_pg is tested with"
        " (2.11 to 2.15); trying it. If the build or a collective fails, install a tested"
        " torch (pip install 'torch>=2.11,<2.16') or a newer fairring_pg."
    )
    out, err = _finish(_start_load(src, name, build_dir, torch_version="2.99.0"))
    assert out == "11"
    lines = err.splitlines()
    assert lines[0] == note and lines.count(note) == 1
    assert lines[1].startswith("fairring_pg: compiling the C++ core")
    # Said once per build: a load from the cache is silent.
    assert _finish(_start_load(src, name, build_dir, torch_version="2.99.0")) == ("11", "")

    # A build that fails with an untested torch ends with the same advice.
    (src / "tiny.cpp").write_text("this is not C++;\n")
    proc = _start_load(src, name, build_dir, torch_version="2.99.0")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode != 0 and out == ""
    assert err.splitlines()[-1] == note
    assert "RuntimeError: fairring_pg: building the C++ extension failed in" in err


def test_a_process_waiting_on_anothers_compile_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The compiling process may report where this one's output does not go (a killed
    # rank's): a wait past the interval says what it waits for.
    import fcntl
    import threading

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(_build, "PROGRESS_INTERVAL_S", 0.05)
    lock_path = tmp_path / "build.lock"
    with open(lock_path, "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        threading.Timer(0.4, fcntl.flock, (holder, fcntl.LOCK_UN)).start()
        began = time.monotonic()
        with _build._exclusive(lock_path):
            waited = time.monotonic() - began
    lines = capsys.readouterr().err.splitlines()
    assert waited >= 0.35
    assert len(lines) >= 3, lines
    expected = "fairring_pg: waiting for another process to finish compiling the C++ core"
    assert all(line.startswith(f"{expected} ({tmp_path / 'build'}, ") for line in lines), lines
