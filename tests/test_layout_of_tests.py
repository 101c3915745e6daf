"""The tests mirror the tree and share code only through tests/helpers/: no test module imports another test
module or a conftest (fixtures come from conftest.py files, functions from `helpers.*`), and every test
module's name is unique (pytest's default import mode names a module by its file name)."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules_of(source: str) -> set[str]:
    """Top-level names of the modules `source` imports, lazy (function-level) imports included; relative
    imports left out. `import a.b` / `from c import d` / `def f(): from e.f import g`: {"a", "c", "e"}."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def imported_modules(path: Path) -> set[str]:
    return imported_modules_of(path.read_text())


def modules_of_tests() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_no_test_module_imports_another_or_a_conftest():
    bad = {}
    for path in modules_of_tests():
        wrong = {m for m in imported_modules(path) if m.startswith("test_") or m == "conftest"}
        if wrong:
            bad[str(path.relative_to(TESTS))] = sorted(wrong)
    assert not bad, f"import these from tests/helpers/ (or make them fixtures in a conftest.py): {bad}"


def test_helpers_and_conftests_import_no_test_module():
    for path in [*(TESTS / "helpers").glob("*.py"), *TESTS.rglob("conftest.py")]:
        assert not {m for m in imported_modules(path) if m.startswith("test_")}, path


def test_test_module_names_are_unique():
    names = Counter(p.name for p in modules_of_tests())
    assert not [n for n, k in names.items() if k > 1], "pytest's default import mode needs unique file names"


def test_the_parser_sees_lazy_imports():
    assert imported_modules_of("import a.b\nfrom c import d\ndef f():\n    from e.f import g\n") == {"a", "c", "e"}
    assert imported_modules_of("def f():\n    from test_x import y\n") == {"test_x"}
    assert imported_modules_of("from . import x\nimport conftest\n") == {"conftest"}
