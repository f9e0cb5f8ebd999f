"""The package reads as the pipeline: imports run one way, modules stay small,
and nothing assigns to Keras.

Stage order (a module may import its own stage and earlier ones only):

    errors, progress, lazy_names, compat  (0: below all; compat wraps every
                                              Keras and JAX private and imports
                                              only `errors`)
    plans                                 (1: the contract, plain data)
    runtime                               (2: devices, processes, collectives;
                                              speaks the mesh vocabulary)
    io                                    (3: weight files and checkpoint
                                              formats: tensors in and out of
                                              files, knowing no plan)
    trace                                 (4: model → TracedModel)
    graph                                 (5: TracedModel → AxisGraph)
    planner                               (6: AxisGraph → ShardingPlan)
    report                                (7: compiled program → evidence)
    apply                                 (8: ShardingPlan → running model;
                                              `TensorParallel.inspect` reports)
    checkpoint                            (9: reads and writes applied models)
    testing                               (10: model zoo, plan → compile →
                                              inspect, reference plans: what
                                              tests, benchmarks and the command
                                              line check plans with)
    cli, __main__                         (11: the command line)

`keras_autoshard/__init__.py` and its public modules `building.py`,
`distributed.py`, `types.py` (and the deprecated `collectives.py`) only name
the public API, lazily, and are left out of the order.

Backend dispatch (`TensorParallel`, `AutoShardDistribution`, collectives)
names its backend modules as strings resolved when a backend is asked for, as
Keras does; `test_backend_dispatch_stays_in_its_stage` checks those names.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from tools import python_source

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1] / "keras_autoshard"

STAGES = {
    "errors": 0,
    "progress": 0,
    "lazy_names": 0,
    "compat": 0,
    "plans": 1,
    "runtime": 2,
    "io": 3,
    "trace": 4,
    "graph": 5,
    "planner": 6,
    "report": 7,
    "apply": 8,
    "checkpoint": 9,
    "testing": 10,
    "cli": 11,
    "__main__": 11,
}
PUBLIC_FRONTS = {
    "keras_autoshard",
    "keras_autoshard.building",
    "keras_autoshard.collectives",
    "keras_autoshard.distributed",
    "keras_autoshard.types",
}
MAX_MODULE_LINES = 600


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _stage(module: str) -> int:
    top = module.split(".")[1]
    if top not in STAGES:
        raise AssertionError(f"{module} belongs to no stage; add it to STAGES.")
    return STAGES[top]


def _is_type_checking_block(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    )


def _imported_modules(module: str) -> set[str]:
    """Package modules `module` imports anywhere (functions included), except
    annotation-only imports under `if TYPE_CHECKING:`."""
    path = MODULES[module]
    tree = python_source.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if _is_type_checking_block(node):
            skipped.update(id(child) for child in ast.walk(node))
    imported = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")
            if node.level:
                base = base if path.name == "__init__.py" else base[:-1]
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [
                f"{prefix}.{alias.name}"
                if f"{prefix}.{alias.name}" in MODULES
                else prefix
                for alias in node.names
            ]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names = [node.args[0].value]
        else:
            continue
        imported.update(name for name in names if name in MODULES and name != module)
    return imported


IMPORT_GRAPH = {module: _imported_modules(module) for module in MODULES}


def test_the_package_import_graph_has_no_cycles():
    state: dict[str, str] = {}
    cycles = []

    def visit(module, stack):
        state[module] = "open"
        for target in sorted(IMPORT_GRAPH[module]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert not cycles, "Import cycles:\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


def test_no_module_imports_a_later_stage():
    backwards = [
        f"{module} (stage {_stage(module)}) imports {target} (stage {_stage(target)})"
        for module, targets in sorted(IMPORT_GRAPH.items())
        if module not in PUBLIC_FRONTS
        for target in sorted(targets)
        if target not in PUBLIC_FRONTS and _stage(target) > _stage(module)
    ]
    assert not backwards, "\n".join(backwards)


def test_compat_imports_nothing_of_the_package_but_errors():
    compat = {
        module for module in MODULES if module.startswith("keras_autoshard.compat")
    }
    reaching_out = {
        module: sorted(IMPORT_GRAPH[module] - compat - {"keras_autoshard.errors"})
        for module in sorted(compat)
    }
    assert compat and not any(reaching_out.values()), reaching_out


def test_the_import_graph_sees_imports_inside_functions():
    # The planner imports the graph builder; the runtime imports JAX's
    # processes inside a function only: both must be edges.
    assert (
        "keras_autoshard.graph.builder"
        in IMPORT_GRAPH["keras_autoshard.planner.planner"]
    )
    assert (
        "keras_autoshard.runtime.jax_processes"
        in IMPORT_GRAPH["keras_autoshard.runtime.cluster"]
    )


def test_backend_dispatch_stays_in_its_stage():
    from keras_autoshard.apply import auto_distribution, tensor_parallel

    for table in (auto_distribution.BACKEND_CLASSES, tensor_parallel.BACKEND_CLASSES):
        for module_name, _ in table.values():
            assert module_name in MODULES, module_name
            assert module_name.startswith("keras_autoshard.apply."), module_name
            # The backend module imports the base, never the reverse.
            assert not IMPORT_GRAPH[module_name] & {
                "keras_autoshard.apply.jax.tensor_parallel",
                "keras_autoshard.apply.torch.tensor_parallel",
                "keras_autoshard.apply.tensorflow.tensor_parallel",
            } - {module_name}


def test_no_module_is_over_600_lines():
    long_modules = {
        module: len(path.read_text().splitlines())
        for module, path in MODULES.items()
        if len(path.read_text().splitlines()) > MAX_MODULE_LINES
    }
    assert not long_modules, long_modules


def _keras_names(tree: ast.Module) -> set[str]:
    """Local names bound to Keras modules, classes or functions."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "keras":
                    names.add((alias.asname or alias.name).split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] == "keras"
        ):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def keras_assignments(source: str) -> list[str]:
    """Assignments to attributes of Keras modules or classes in `source`:
    `keras.x = ...`, `Trainer.fit = ...`, `setattr(Trainer, ...)`,
    `del keras.x`, augmented assignments too."""
    tree = python_source.parse(source)
    keras_names = _keras_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
        ):
            if _root_name(node.args[0]) in keras_names:
                found.append(f"line {node.lineno}: {node.func.id} on a Keras name")
            continue
        for target in targets:
            if isinstance(target, ast.Attribute) and _root_name(target) in keras_names:
                found.append(f"line {node.lineno}: assigns {ast.unparse(target)}")
    return found


def test_the_keras_assignment_scan_finds_patches():
    # The scanner itself must be able to fail.
    patched = (
        "import keras\n"
        "from keras.src.trainers import trainer as keras_trainer\n"
        "from keras.src.backend.jax.trainer import JAXTrainer\n"
        "keras_trainer.Trainer._symbolic_build = f\n"
        "setattr(JAXTrainer, 'predict', g)\n"
        "keras.config.x += 1\n"
        "model.fit = h\n"
    )
    assert len(keras_assignments(patched)) == 3


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_code_assigns_to_keras_classes_or_modules(module):
    assert keras_assignments(MODULES[module].read_text()) == []


def test_the_mesh_axis_vocabulary_is_defined_once_and_roles_never_reuse_it():
    from keras_autoshard.plans import mesh

    names = ("DATA_AXIS_NAMES", "MODEL_AXIS_NAMES", "DEFAULT_AXIS_NAMES")
    definitions = [
        (module, node.targets[0].id)
        for module, path in MODULES.items()
        for node in python_source.parse(path.read_text()).body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in names + ("DATA_AXIS", "MODEL_AXIS")
    ]
    assert {module for module, _ in definitions} == {"keras_autoshard.plans.mesh"}
    roles_source = MODULES["keras_autoshard.planner.roles"].read_text()
    role_names = set(ast.literal_eval(s) for s in _string_literals(roles_source))
    axis_names = mesh.DATA_AXIS_NAMES | mesh.MODEL_AXIS_NAMES
    assert "examples" in role_names and not role_names & axis_names


def _string_literals(source: str) -> list[str]:
    return [
        repr(node.value)
        for node in ast.walk(python_source.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]
