"""Every planner module and every primitive-rule family has a unit test of
its own: a test file at the mirrored path that imports it.

- `keras_autoshard/planner/<module>.py` → `tests/planner/test_<module>.py`
- a module of `keras_autoshard/graph/jaxpr/` that registers rules with
  `@primitive_rule(...)` → `tests/graph/jaxpr/test_<module>.py`

"Imports it" means an `import keras_autoshard.<...>.<module>`, a
`from keras_autoshard.<...>.<module> import ...` or a
`from keras_autoshard.<...> import <module>` anywhere in the test file.
"""

from __future__ import annotations

import ast
import pathlib

from tools import python_source

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_ROOT = ROOT / "keras_autoshard"


def _dotted(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _registers_rules(path: pathlib.Path) -> bool:
    """Whether a function of `path` is decorated with `primitive_rule(...)`."""
    tree = python_source.parse(path.read_text())
    return any(
        isinstance(decorator, ast.Call)
        and getattr(decorator.func, "id", getattr(decorator.func, "attr", None))
        == "primitive_rule"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        for decorator in node.decorator_list
    )


def modules_needing_unit_tests() -> dict[str, pathlib.Path]:
    """Module name → the test file that must import it."""
    needed = {}
    for path in sorted((PACKAGE_ROOT / "planner").glob("*.py")):
        if path.name != "__init__.py":
            needed[_dotted(path)] = ROOT / "tests" / "planner" / f"test_{path.name}"
    for path in sorted((PACKAGE_ROOT / "graph" / "jaxpr").glob("*.py")):
        if _registers_rules(path):
            test = ROOT / "tests" / "graph" / "jaxpr" / f"test_{path.name}"
            needed[_dotted(path)] = test
    return needed


def imported_modules(test_file: pathlib.Path) -> set[str]:
    """Modules `test_file` imports, by full dotted name (a `from package
    import name` counts as importing `package.name` too)."""
    imported = set()
    for node in ast.walk(python_source.parse(test_file.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    return imported


def test_the_rule_families_are_found():
    found = {m for m in modules_needing_unit_tests() if ".graph.jaxpr." in m}
    assert "keras_autoshard.graph.jaxpr.contractions" in found
    assert "keras_autoshard.graph.jaxpr.registry" not in found
    assert "keras_autoshard.graph.jaxpr.walker" not in found


def test_every_planner_module_and_rule_family_has_a_unit_test_of_its_own():
    missing = []
    for module, test_file in modules_needing_unit_tests().items():
        if not test_file.exists() or module not in imported_modules(test_file):
            missing.append(
                f"{module}: create {test_file.relative_to(ROOT)} importing it"
            )
    assert not missing, "Modules without a unit test of their own:\n" + "\n".join(
        missing
    )
