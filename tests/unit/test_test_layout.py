"""The suite's own layout: helpers live in tests/support/, and no test module (nor a conftest)
imports another test module or a conftest, so each test file can be read, run and moved alone."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parents[1]


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def test_no_test_module_imports_another_test_module_or_a_conftest():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for module in _imported_modules(path):
            last = module.rsplit(".", 1)[-1]
            if module.startswith("tests.") and (last.startswith("test_") or last == "conftest"):
                offenders.append(f"{path.relative_to(TESTS)} imports {module}")
    assert not offenders, "\n".join(offenders)


def test_helpers_are_in_support_and_test_folders_hold_only_tests():
    strays = [
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("*.py")
        if path.parent != TESTS / "support"
        and not path.name.startswith("test_")
        and path.name not in ("conftest.py", "__init__.py")
    ]
    assert not strays, strays
