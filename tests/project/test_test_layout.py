"""The tests' own layout: helpers shared by several test modules live in ``tests/support``,
never in a test module another one imports (pytest would then collect and run that
module's tests under two names, and a helper's home would depend on which test came first)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_another_test_module() -> None:
    modules = {p.stem for p in TESTS.rglob("test_*.py")}
    offenders = sorted(
        f"{path.relative_to(TESTS)} imports {name}"
        for path in TESTS.rglob("*.py")
        for name in _imported_modules(path) & modules
    )
    assert offenders == []
