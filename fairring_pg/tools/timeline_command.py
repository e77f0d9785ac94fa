"""Merge the per-rank Timeline traces (``FAIRRING_TIMELINE``) into one Chrome trace.

    python -m fairring_pg.tools.timeline_command merged.json trace.rank*.json

Each rank writes its own file (the ranks share no clock but the host's, and must not
share a file); every event already carries its rank as ``pid``, so merging is a
concatenation. Open the result in chrome://tracing or https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_trace(path: Path) -> list[dict[str, Any]]:
    """Events of one rank's trace, including one cut short by a crash (no closing ']')."""
    text = path.read_text().strip()
    if not text:
        return []
    try:
        events = json.loads(text)
    except json.JSONDecodeError:
        # The JSON array format lets a writer stop anywhere after a complete event.
        events = json.loads(text.rstrip(",\n ") + "]")
    if not isinstance(events, list):
        raise ValueError(f"{path}: expected a JSON array of trace events")
    return events


def merge(inputs: Sequence[Path], output: Path) -> int:
    """Write the events of every input into ``output``; returns how many."""
    events: list[dict[str, Any]] = []
    for path in inputs:
        events.extend(load_trace(path))
    # Metadata first, then by time: viewers do not need it, but people reading the file do.
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    output.write_text(json.dumps(events, separators=(",", ":")))
    return len(events)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Merge fairring per-rank timelines.")
    parser.add_argument("output", type=Path)
    parser.add_argument("inputs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    count = merge(args.inputs, args.output)
    print(f"wrote {count} events from {len(args.inputs)} trace(s) to {args.output}")


if __name__ == "__main__":
    main()
