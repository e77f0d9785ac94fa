"""The native stacks of a hung rank, for its log: what multiprocess.kill_rank writes
before it kills a rank that did not finish in time, so that a hang in C++ shows where.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path


def native_stacks(pid: int) -> str:
    """One line per thread of ``pid``: its innermost frames, from gdb without loading
    the libraries' symbols (seconds, not minutes, with torch loaded); fairring's own
    frames named by addr2line, the others as library+offset."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb: native stacks not shown)\n"
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        dump = subprocess.run(
            [gdb, "-p", str(pid), "-batch", "-nx", "-iex", "set auto-solib-add off"]
            + ["-ex", "thread apply all bt 10"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(native stacks not shown: {exc})\n"
    threads: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            threads.append([])
        elif threads and (frame := re.match(r"#\d+\s+(?:(0x[0-9a-f]+) in )?(\S+)", line)):
            address, name = frame.groups()
            threads[-1].append(
                name if name != "??" or address is None else _where(int(address, 16), maps)
            )
    lines = [f"native thread {i}: " + " < ".join(frames) for i, frames in enumerate(threads)]
    return "native stacks (innermost first), from gdb:\n" + "\n".join(lines) + "\n"


def _where(address: int, maps: list[str]) -> str:
    for mapping in maps:
        fields = mapping.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high and len(fields) >= 6:
            path, offset = fields[5], address - low + int(fields[2], 16)
            if "fairring_pg" in path and shutil.which("addr2line"):
                out = subprocess.run(
                    ["addr2line", "-f", "-C", "-e", path, hex(offset)],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout.split("\n")[0]
                return out[:80] or f"{Path(path).name}+{offset:#x}"
            return f"{Path(path).name}+{offset:#x}"
    return hex(address)
