"""The house rules, checked on the checkout: no source file over 600 lines, no function
over 80 (Python and C++), no import circle inside fairring_pg, no circle among the C++
core's folders (each folder one concept, lower ones knowing nothing of higher ones), and
scripts/ holding commands only: nothing imports them (what a command shares lives in the
package or in tests/).

Each rule is a pure function over file contents (``long_files``, ``long_python_functions``,
``long_cpp_functions``, ``import_cycles``, ``cpp_folder_cycles``, ``imports_of_commands``),
so that the tests below can also show each one catching a planted violation.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def source_files() -> list[Path]:
    """src/**/*.{h,cpp}, fairring_pg/**/*.py, tests/**/*.py, tests/native/*, bench/*.py,
    scripts/*."""
    found: set[Path] = set()
    for pattern in ("src/**/*.h", "src/**/*.cpp", "fairring_pg/**/*.py", "tests/**/*.py"):
        found.update(ROOT.glob(pattern))
    for pattern in ("tests/native/*", "bench/*.py", "scripts/*"):
        found.update(p for p in ROOT.glob(pattern) if p.is_file())
    return sorted(p for p in found if "__pycache__" not in p.parts)


def long_files(texts: Mapping[str, str], limit: int = MAX_FILE_LINES) -> list[str]:
    """'name: N lines' for each text over ``limit`` lines."""
    counts = {name: len(text.splitlines()) for name, text in texts.items()}
    return [f"{name}: {n} lines" for name, n in counts.items() if n > limit]


def long_python_functions(texts: Mapping[str, str], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'name:line function: N lines' for each def (nested ones too) over ``limit``
    lines, from its ``def`` (decorators aside) to its last line."""
    found = []
    for name, text in texts.items():
        for node in ast.walk(ast.parse(text, name)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    return found


# A line that opens a function definition at namespace or class level: it starts at
# column 0 or 2 (clang-format's namespace and class-member indent), is not a control
# statement, and holds a name followed by '(' (a constructor's initializer list and a
# signature over several lines are followed to their '{').
_CPP_OPENER = re.compile(r"^ {0,2}[A-Za-z_~][\w:<>,\s*&~\[\]]*\(")
_CPP_NOT_A_FUNCTION = re.compile(
    r"^\s*(if|for|while|switch|return|else|do|case|namespace|using|typedef|#|//|/\*|\*)\b"
)


def _strip_cpp_line(line: str) -> str:
    """The line without its // comment and the contents of its string and char
    literals, so that braces in them are not counted."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])*'", "''", line)
    return line.split("//", 1)[0]


def long_cpp_functions(texts: Mapping[str, str], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'name:line signature: N lines' for each C++ function whose body, from its opening
    line to its closing brace, is over ``limit`` lines.

    A heuristic, not a parser: a function starts on a line that ``_CPP_OPENER`` matches
    outside any function body, whose statement reaches a '{' before a ';' (so
    declarations and calls at namespace level are skipped); its body ends at the brace
    that matches. Lambdas and local classes count within their function; a class body is
    not a function (its opening line has no '(' before its '{'); block comments whose
    lines start with '*' or '/*' are skipped.
    """
    found = []
    for name, text in texts.items():
        lines = [_strip_cpp_line(line) for line in text.splitlines()]
        i = 0
        while i < len(lines):
            line = lines[i]
            if not _CPP_OPENER.match(line) or _CPP_NOT_A_FUNCTION.match(line):
                i += 1
                continue
            # Follow the statement to its first '{' or ';'.
            j = i
            while j < len(lines) and "{" not in lines[j] and ";" not in lines[j]:
                j += 1
            if j == len(lines) or ";" in lines[j].split("{", 1)[0]:
                i += 1
                continue
            depth, k = 0, j
            while k < len(lines):
                depth += lines[k].count("{") - lines[k].count("}")
                if depth <= 0 and "}" in lines[k]:
                    break
                k += 1
            length = k - i + 1
            if length > limit:
                found.append(f"{name}:{i + 1} {line.strip()[:60]}: {length} lines")
            i = k + 1
    return found


def _module_name(path: Path, package_root: Path) -> str:
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(module: str, text: str, is_package: bool, known: Iterable[str]) -> set[str]:
    """The modules of ``known`` that ``module``'s text imports, at top level or inside a
    function: ``import a.b``, ``from a import b`` (b a module or a name of a), and the
    relative forms."""
    known = set(known)
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(text, module)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for imported in names:
            # "a.b.c" imports a, a.b and a.b.c; a package's __init__ runs for each.
            parts = imported.split(".")
            for n in range(1, len(parts) + 1):
                prefix = ".".join(parts[:n])
                if prefix in known and prefix != module:
                    found.add(prefix)
    return found


def _strongly_connected(graph: Mapping[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module, or of one that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def import_cycles(modules: Mapping[str, tuple[str, bool]]) -> list[set[str]]:
    """The import circles among ``modules`` (name -> (text, is a package)): each set of
    modules that import one another, directly or through others. A module inside a
    package is not counted as importing that package: importing ``a.b`` runs ``a``
    first, but ``a`` finishes without waiting for ``a.b`` unless it imports it itself."""
    graph = {
        name: {
            m for m in imports_of(name, text, is_package, modules) if not name.startswith(m + ".")
        }
        for name, (text, is_package) in modules.items()
    }
    return _strongly_connected(graph)


_CPP_INCLUDE = re.compile(r'^\s*#\s*include\s+"([A-Za-z0-9_]+)/', re.MULTILINE)


def cpp_folder_graph(texts: Mapping[str, str]) -> dict[str, set[str]]:
    """Which folders of src/ each folder's files include from (``#include "folder/..."``),
    by file path (``src/<folder>/<file>``) -> text."""
    graph: dict[str, set[str]] = {}
    for path, text in texts.items():
        parts = Path(path).parts
        if len(parts) < 3 or parts[0] != "src":
            continue
        folder = parts[1]
        graph.setdefault(folder, set()).update(
            other for other in _CPP_INCLUDE.findall(text) if other != folder
        )
    return graph


def cpp_folder_cycles(texts: Mapping[str, str]) -> list[set[str]]:
    """The circles among the C++ folders: each set of folders that include from one
    another, directly or through others."""
    return _strongly_connected(cpp_folder_graph(texts))


_SCRIPTS_ON_PATH = re.compile(r"sys\.path\.(insert|append)\(.*[\"']scripts[\"']")


def imports_of_commands(texts: Mapping[str, str], commands: Iterable[str]) -> list[str]:
    """'name: import X' for each import of a module named like one of ``commands`` (the
    stems of scripts/*.py), and 'name:line: sys.path' for each line that puts a folder
    named scripts on sys.path."""
    names = set(commands)
    found = []
    for name, text in texts.items():
        for node in ast.walk(ast.parse(text, name)):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            found += [f"{name}: import {m}" for m in modules if m.split(".")[0] in names]
        for number, line in enumerate(text.splitlines(), 1):
            if _SCRIPTS_ON_PATH.search(line):
                found.append(f"{name}:{number}: sys.path")
    return found


def package_modules(package: Path) -> dict[str, tuple[str, bool]]:
    return {
        _module_name(path, package): (path.read_text(), path.name == "__init__.py")
        for path in sorted(package.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _texts(paths: Iterable[Path]) -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(errors="replace") for p in paths}


# ------------------------------------------------------------------ the checkout


def test_no_source_file_is_over_600_lines() -> None:
    assert long_files(_texts(source_files())) == []


def test_no_python_function_is_over_80_lines() -> None:
    python = [p for p in source_files() if p.suffix == ".py"]
    assert long_python_functions(_texts(python)) == []


def test_no_cpp_function_is_over_80_lines() -> None:
    cpp = [p for p in source_files() if p.suffix in (".h", ".cpp")]
    assert long_cpp_functions(_texts(cpp)) == []


def test_fairring_pg_has_no_import_circle() -> None:
    assert import_cycles(package_modules(ROOT / "fairring_pg")) == []


def test_the_cpp_folders_have_no_circle() -> None:
    cpp = [p for p in source_files() if p.parts[len(ROOT.parts)] == "src"]
    assert cpp_folder_cycles(_texts(cpp)) == []


def test_nothing_imports_a_command() -> None:
    commands = [p.stem for p in (ROOT / "scripts").glob("*.py")]
    assert {"chaos", "soak", "netns_cluster"} <= set(commands)
    python = [p for p in source_files() if p.suffix == ".py"]
    assert imports_of_commands(_texts(python), commands) == []


# ------------------------------------------------------- each rule catches its case


def test_a_planted_import_of_a_command_is_caught() -> None:
    folder = "scripts"  # not in this file's own line, which the checkout's rule reads
    texts = {
        "ok.py": "from fairring_pg.tools import netns_cluster\nimport chaos_jobs\n",
        "bad.py": f"import sys\nsys.path.insert(0, str(ROOT / {folder!r}))\nimport chaos\n",
        "from.py": "from netns_cluster import running_cluster\n",
    }
    assert imports_of_commands(texts, ["chaos", "netns_cluster"]) == [
        "bad.py: import chaos",
        "bad.py:2: sys.path",
        "from.py: import netns_cluster",
    ]


def test_a_planted_long_file_is_caught() -> None:
    assert long_files({"short.py": "x = 1\n" * 600}) == []
    assert long_files({"long.py": "x = 1\n" * 601}) == ["long.py: 601 lines"]


def test_a_planted_long_python_function_is_caught() -> None:
    def function(body_lines: int) -> str:
        return "def f() -> None:\n" + "    x = 1\n" * body_lines

    assert long_python_functions({"ok.py": function(79)}) == []
    method = "class C:\n" + textwrap.indent(function(80), "    ")
    assert long_python_functions({"method.py": method}) == ["method.py:2 f: 81 lines"]
    assert long_python_functions({"long.py": function(80)}) == ["long.py:1 f: 81 lines"]


def test_a_planted_long_cpp_function_is_caught() -> None:
    def function(body_lines: int, indent: str = "") -> str:
        head = f"{indent}void Engine::run(\n{indent}    int a) {{\n"
        return head + f"{indent}  call(a);\n" * body_lines + f"{indent}}}\n"

    assert long_cpp_functions({"ok.cpp": function(77)}) == []
    assert long_cpp_functions({"long.cpp": function(78)}) == [
        "long.cpp:1 void Engine::run(: 81 lines"
    ]
    member = "class Engine {\n public:\n" + function(78, "  ") + "};\n"
    assert len(long_cpp_functions({"member.h": member})) == 1
    # A declaration, a class body and braces inside strings or comments are not bodies.
    text = 'void f(int a);\nstruct S {\n  int x;\n};\nvoid g() {\n  s("{"); // {\n}\n'
    assert long_cpp_functions({"short.cpp": text}, limit=2) == ["short.cpp:5 void g() {: 3 lines"]


def test_a_planted_import_circle_is_caught() -> None:
    modules = {
        "pkg": ("", True),
        "pkg.a": ("from pkg import b\n", False),
        "pkg.b": ("def f():\n    from pkg.c import g\n", False),
        "pkg.c": ("import pkg.a\n", False),
        "pkg.d": ("from . import a\n", False),
        "pkg.sub": ("from pkg.sub import e\n", True),
        "pkg.sub.e": ("from ..d import x\n", False),
    }
    assert import_cycles(modules) == [{"pkg.a", "pkg.b", "pkg.c"}]
    del modules["pkg.c"]
    assert import_cycles(modules) == []


def test_a_planted_cpp_folder_circle_is_caught() -> None:
    cpp = _texts(p for p in source_files() if p.parts[len(ROOT.parts)] == "src")
    # As it was: the device path's interface among the c10d face's files, which
    # include the sub-groups' path, which implements that interface.
    assert "subgroups" in cpp_folder_graph(cpp)["backend"]
    planted = {**cpp, "src/subgroups/planted.h": '#include "backend/device_path.h"\n'}
    [circle] = cpp_folder_cycles(planted)
    assert {"backend", "subgroups"} <= circle
    # Through a third folder, and an include inside a comment-free line with spaces.
    texts = {
        "src/a/x.h": '#include "b/y.h"\n',
        "src/b/y.h": '#  include "c/z.h"\n#include <vector>\n',
        "src/c/z.h": '#include "c/w.h"\n',
        "tests/native/t.cpp": '#include "a/x.h"\n',
    }
    assert cpp_folder_cycles(texts) == []
    texts["src/c/z.h"] += '#include "a/x.h"\n'
    assert cpp_folder_cycles(texts) == [{"a", "b", "c"}]
