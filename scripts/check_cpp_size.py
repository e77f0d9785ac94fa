"""Fail if a C++ file of src/ or tests/native/ is over 600 lines or a function over 80.

A function is a brace block opened at namespace or class level whose header has a
parameter list; its length counts from the header's first line to its closing brace.
Comments and string literals are blanked first, so their braces do not count.
"""

import re
import sys
from pathlib import Path

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
CONTAINER = re.compile(r"\b(namespace|class|struct|union|enum)\b[^()]*$|^\s*extern\s+\"C\"")


def blank(text: str) -> str:
    """Comments and literals replaced by spaces, newlines kept."""
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def long_functions(text: str):
    code = blank(text)
    stack = []  # (kind, start line)
    header_start = None
    header = ""
    line = 1
    for ch in code:
        if ch == "\n":
            line += 1
        if ch == "{":
            in_body = any(kind != "container" for kind, _, _ in stack)
            if in_body:
                stack.append(("block", line, ""))
            elif CONTAINER.search(header.strip()) or "(" not in header:
                stack.append(("container", line, ""))
            else:
                name = re.findall(r"([~\w:]+)\s*\(", header)
                stack.append(("function", header_start or line, name[0] if name else "?"))
            header, header_start = "", None
        elif ch == "}":
            kind, start, name = stack.pop() if stack else ("container", line, "")
            if kind == "function" and line - start + 1 > MAX_FUNCTION_LINES:
                yield name, start, line - start + 1
            header, header_start = "", None
        elif ch == ";":
            header, header_start = "", None
        else:
            if not ch.isspace() and header_start is None:
                header_start = line
            header += ch


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    bad = 0
    sources = (p for d in ("src", "tests/native") for p in (root / d).rglob("*"))
    for path in sorted(p for p in sources if p.suffix in (".h", ".cpp")):
        text = path.read_text()
        rel = path.relative_to(root)
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            print(f"{rel}: {lines} lines (at most {MAX_FILE_LINES})")
            bad += 1
        for name, start, length in long_functions(text):
            print(f"{rel}:{start}: {name} is {length} lines (at most {MAX_FUNCTION_LINES})")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
