"""Which torch releases fairring_pg accepts: the range pyproject.toml declares and the
README names, and what a version outside it gets (tests/test_build_progress.py runs the
whole first use with a faked torch version)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fairring_pg import _torch_range

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "version",
    ["2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0+cu132", "2.15.0a0+git5e0f1a2"],
)
def test_the_tested_releases_pass_silently(version: str) -> None:
    assert _torch_range.check(version) is None


@pytest.mark.parametrize("version", ["2.10.2", "2.9.0+cpu", "1.13.1", "0.4.1"])
def test_an_older_torch_is_refused_naming_the_version_and_the_fix(version: str) -> None:
    with pytest.raises(RuntimeError) as info:
        _torch_range.check(version)
    assert str(info.value) == (
        f"fairring_pg needs torch >= 2.11 (tested: 2.11 to 2.15), found torch {version}: its"
        " C++ core does not compile against this torch. Upgrade torch"
        " (pip install 'torch>=2.11,<2.16'), then run again."
    )


@pytest.mark.parametrize("version", ["2.16.0", "2.16.0.dev20260101+cpu", "3.0.0"])
def test_a_newer_torch_gets_a_note(version: str) -> None:
    assert _torch_range.check(version) == (
        f"torch {version} is newer than the releases fairring_pg is tested with (2.11 to"
        " 2.15); trying it. If the build or a collective fails, install a tested torch"
        " (pip install 'torch>=2.11,<2.16') or a newer fairring_pg."
    )


def test_pyproject_declares_the_oldest_and_the_readme_names_the_range() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    (torch_requirement,) = re.findall(r'"torch\s*([<>=!~][^"]*)"', pyproject)
    oldest = ".".join(map(str, _torch_range.OLDEST))
    assert torch_requirement == f">={oldest}", torch_requirement
    install = (REPO / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert f"tested with torch {_torch_range.tested_range()}" in install
