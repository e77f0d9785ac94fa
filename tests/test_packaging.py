"""Every package the repository's code imports is declared in pyproject.toml: the package
and scripts/ by the dependencies, tests/ also by the `test` extra, bench/ by the `bench`
extra. .ci/run runs the suite in a fresh virtual environment, which catches what the
tests import; this also covers what they never run (bench/, scripts/). An import
inside ``try: ... except ImportError`` is optional and needs no declaration."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Folder -> the extras whose packages it may import besides the dependencies.
FOLDERS = {"fairring_pg": (), "scripts": (), "tests": ("test",), "bench": ("bench",)}


def _declared() -> dict[str | None, set[str]]:
    """Requirement names by extra (None: the dependencies), as installed."""
    by_extra: dict[str | None, set[str]] = {}
    for requirement in metadata.requires("fairring_pg") or []:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        assert name, requirement
        by_extra.setdefault(extra.group(1) if extra else None, set()).add(_normal(name[0]))
    return by_extra


def _normal(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _local_modules() -> set[str]:
    names = {p.stem for folder in FOLDERS for p in (REPO / folder).rglob("*.py")}
    return names | set(FOLDERS)


def _optional(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a try whose handler catches ImportError."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
        if caught & {"ImportError", "ModuleNotFoundError"}:
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return found


def third_party_imports(path: Path, local: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    optional = _optional(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in local}


def test_every_import_is_declared() -> None:
    declared = _declared()
    distributions = metadata.packages_distributions()
    local = _local_modules()
    undeclared = []
    for folder, extras in FOLDERS.items():
        allowed = declared.get(None, set()).union(*(declared.get(e, set()) for e in extras))
        for path in sorted((REPO / folder).rglob("*.py")):
            for module in sorted(third_party_imports(path, local)):
                # Not installed (a bench package in a test environment): by its own name.
                dists = {_normal(d) for d in distributions.get(module, [module])}
                if not dists & allowed:
                    undeclared.append(f"{path.relative_to(REPO)} imports {module}")
    assert not undeclared, (
        "imported but not declared in pyproject.toml (or declared but not installed:"
        " pip install -e '.[test]'):\n  " + "\n  ".join(undeclared)
    )


def test_the_check_sees_an_undeclared_import(tmp_path: Path) -> None:
    code = "import torch\nimport requests.adapters\nfrom yaml import safe_load\n"
    code += "try:\n    import nvidia\nexcept ImportError:\n    pass\nimport common\n"
    (tmp_path / "x.py").write_text(code)
    assert third_party_imports(tmp_path / "x.py", {"common"}) == {"torch", "requests", "yaml"}


def test_numpy_is_a_dependency() -> None:
    # No file imports it, torch does: without it `import torch` warns in every rank and
    # torch.distributed's *_object collectives raise.
    assert "numpy" in _declared()[None]
