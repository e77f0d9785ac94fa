"""The fault points' table (src/faults/fault_points.h, kPoints): arming a name that is not
in it fails, naming the points there are, so a renamed or removed point cannot leave a
test arming nothing; and the table is the one docs/design.md lists."""

from __future__ import annotations

import re
from pathlib import Path

import fault_points
import pytest

DESIGN = Path(__file__).resolve().parent.parent / "docs" / "design.md"


def test_arming_an_unknown_point_fails_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="no fault point is named 'mesh.conect'") as raised:
        fault_points.arm("mesh.conect", "delay", delay_ms=10)
    for point in fault_points.points():
        assert point in str(raised.value)
    fault_points.disarm()


def test_a_known_point_arms_and_counts_nothing_until_it_fires() -> None:
    fault_points.arm("engine.reduce", "throw", key=123456)
    assert fault_points.uses("engine.reduce") == 0
    fault_points.disarm()


def test_the_design_lists_every_point_and_no_other() -> None:
    section = DESIGN.read_text().split("## Fault points", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([a-z._]+)` \|", section, flags=re.MULTILINE))
    assert listed == set(fault_points.points())
