"""The settings table (fairring_pg.config.Config) is the one place a setting is declared:
the README's table is made from it, every FAIRRING_* variable the package or the core
reads comes through it, and the core takes the rows it takes as they are."""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta
from pathlib import Path

from fairring_pg import config as settings
from fairring_pg.config import Config, settings_markdown

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _readme_table() -> str:
    lines = README.read_text().splitlines()
    start = lines.index("| variable | default | meaning |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return "\n".join(lines[start:end])


def test_the_readme_table_is_the_settings_table() -> None:
    # Regenerate with: python -c "from fairring_pg.config import settings_markdown as m; print(m())"
    assert _readme_table() == settings_markdown()


def test_the_readme_names_each_test_switch_and_the_table_has_every_variable() -> None:
    text = README.read_text()
    assert all(f"`{variable}`" in text for variable in settings.testing_variables())
    variables = [f.metadata["variable"] for f in dataclasses.fields(Config)]
    assert len(variables) == len(set(variables))
    for name in ("FAIRRING_NODE", "FAIRRING_BUILD_DIR", "FAIRRING_BUILD_VERBOSE"):
        assert name in variables


def test_no_module_but_the_table_reads_a_fairring_variable() -> None:
    reads = re.compile(r"(environ|getenv)\W[^\n]*FAIRRING_")
    offenders = [
        str(path.relative_to(ROOT))
        for path in [*ROOT.joinpath("fairring_pg").rglob("*.py"), *ROOT.joinpath("src").rglob("*")]
        if path.is_file() and path.name != "config.py" and reads.search(path.read_text())
    ]
    assert offenders == []


def test_a_value_reaches_the_core_options_by_its_row() -> None:
    # The core's own options object, filled by the rows' ``core`` column: a changed value
    # arrives in each field the row names, in no other.
    from types import SimpleNamespace

    from fairring_pg.backend import core_options
    from fairring_pg.topology import build_topology

    class Part(SimpleNamespace):
        pass

    opts = SimpleNamespace(engine=Part(), subgroup=Part())
    config = Config(
        total_memory=3 << 20, pipeline_chunk=5 << 10, slice_scaling=False, rail_congestion="bbr"
    )
    topology = build_topology(0, ["a", "a", "b", "b"], ["h"] * 4)
    core_options(opts, config, topology, "127.0.0.1", "t", timedelta(seconds=1))
    assert opts.engine.total_memory == opts.subgroup.total_memory == 3 << 20
    assert opts.engine.chunk_bytes == 5 << 10
    assert opts.engine.rail_congestion == "bbr"
    assert opts.engine.slice_bytes == config.slice_size  # scaling off: as given
    targets = [t for f in dataclasses.fields(Config) for t in f.metadata["core"]]
    assert sorted(targets) == [
        "engine.chunk_bytes",
        "engine.rail_congestion",
        "engine.total_memory",
        "subgroup.total_memory",
    ]
