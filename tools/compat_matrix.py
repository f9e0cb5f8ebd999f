"""Compatibility run: the built wheel installed as users install it, on the
oldest and the newest supported stacks, and a subset of the suite over every
private seam of Keras and JAX the library uses.

    bash dev.sh matrix                      # every set, then COMPATIBILITY.md
    bash dev.sh matrix oldest nightly       # some sets
    bash dev.sh matrix --python 3.13=/opt/py313/bin/python3.13 newest
    bash dev.sh matrix --render             # rewrite COMPATIBILITY.md only

Each set is a fresh virtual environment under `.matrix/<set>`. The user's
stack (JAX, PyTorch) is installed first, as it would already be; then the
wheel with its extras, and the set records whether that changed the user's
stack. The tests run from a copy of this checkout (taken when the run starts)
against that environment. Results go
to `.matrix/<set>/result.json` and the table to `COMPATIBILITY.md`.

Interpreters: `--python VERSION=PATH`, else the environment variable
`KERAS_AUTOSHARD_PYTHON_<MAJOR>_<MINOR>` (e.g. `KERAS_AUTOSHARD_PYTHON_3_13`),
else `pythonX.Y` on `PATH`, else pyenv's newest installed X.Y.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATRIX_DIR = os.path.join(REPOSITORY, ".matrix")
REPORT = os.path.join(REPOSITORY, "COMPATIBILITY.md")
EXTRAS = "torch,checkpoint,hub,plot"
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3.5")

# The subset of the suite that reaches every Keras and JAX private the library
# uses (keras_autoshard/compat/): the check of the privates themselves,
# planning inside a distribution scope (fit/evaluate/predict under
# AutoShardDistribution), the TensorParallel wrapper, rematerialization (its
# stateless-scope and custom-VJP seams), Orbax checkpoints and sharded loading,
# PyTorch ranks, the TensorFlow backend, multi-process JAX and the command line.
TEST_SUBSET = (
    "tests/compat/test_compat.py",
    "tests/runtime/test_devices.py",
    "tests/apply/test_auto_distribution_scoping.py",
    "tests/apply/test_tensor_parallel.py",
    "tests/graph/test_remat_wrapped.py",
    "tests/apply/test_remat_tied_gradients.py",
    "tests/checkpoint/test_checkpoint_orbax.py",
    "tests/checkpoint/test_checkpoint_loading.py",
    "tests/apply/torch/test_torch_backend.py",
    "tests/checkpoint/test_torch_checkpoint.py",
    "tests/apply/tensorflow/test_tensorflow_backend.py",
    "tests/runtime/test_multiprocess_jax.py",
    "tests/report/test_compiled_report.py",
    "tests/cli/test_cli.py",
    "tests/test_readme.py",
)

# Packages whose versions the table shows.
SHOWN = (
    "jax",
    "jaxlib",
    "keras",
    "keras-nightly",
    "keras-hub",
    "keras-hub-nightly",
    "torch",
    "tensorflow",
    "numpy",
    "orbax-checkpoint",
)


@dataclasses.dataclass(frozen=True)
class MatrixSet:
    """One environment of the compatibility run.

    Attributes:
        name: Folder and table name.
        python: Interpreter version, "3.11".
        description: One line for the table.
        user_stack: Requirements installed before the wheel, as the user's
            environment would already hold them.
        at_lower_bounds: Install every dependency at the lower bound
            `pyproject.toml` declares.
        nightly: Replace Keras and KerasHub by their nightly builds.
        use_machine_pip_config: Keep this machine's pip configuration (its
            local wheel folder); sets that install a PyTorch newer than the
            machine's cap ignore it.
    """

    name: str
    python: str
    description: str
    user_stack: tuple[str, ...]
    at_lower_bounds: bool = False
    nightly: bool = False
    use_machine_pip_config: bool = False


def declared_requirements() -> list[str]:
    """The wheel's requirements: its dependencies and the extras the run uses."""
    with open(os.path.join(REPOSITORY, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    requirements = list(project["dependencies"])
    for extra in EXTRAS.split(","):
        requirements += project["optional-dependencies"][extra]
    return requirements


def lower_bound_pins() -> list[str]:
    """`name==lower` for every declared requirement with a `>=` bound."""
    pins = {}
    for requirement in declared_requirements():
        match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$", requirement)
        name, specifiers = match.group(1).lower(), match.group(3)
        lower = re.search(r">=\s*([^,\s]+)", specifiers)
        if lower:
            pins[name] = f"{name}=={lower.group(1)}"
    return sorted(pins.values())


def matrix_sets() -> dict[str, MatrixSet]:
    """The sets, oldest first."""
    oldest = lower_bound_pins()
    user_oldest = tuple(
        pin for pin in oldest if pin.split("==")[0] in ("jax", "jaxlib", "torch")
    )
    newest_user = ("jax", "jaxlib", "torch")
    return {
        "oldest": MatrixSet(
            "oldest",
            "3.11",
            "Python 3.11, every dependency at its declared lower bound",
            user_oldest,
            at_lower_bounds=True,
            use_machine_pip_config=True,
        ),
        "py312": MatrixSet(
            "py312",
            "3.12",
            "Python 3.12, the newest releases",
            newest_user,
        ),
        "newest": MatrixSet(
            "newest",
            "3.13",
            "Python 3.13, the newest releases",
            newest_user,
        ),
        "nightly": MatrixSet(
            "nightly",
            "3.13",
            "Python 3.13, the newest releases, keras-nightly and keras-hub-nightly",
            newest_user,
            nightly=True,
        ),
    }


def find_python(version: str, overrides: dict[str, str]) -> str:
    """The interpreter for `version` (see the module docstring for the order)."""
    if version in overrides:
        return overrides[version]
    variable = "KERAS_AUTOSHARD_PYTHON_" + version.replace(".", "_")
    if os.environ.get(variable):
        return os.environ[variable]
    candidates = [shutil.which(f"python{version}")]
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    installed = glob.glob(os.path.join(pyenv_root, "versions", f"{version}.*"))
    installed.sort(
        key=lambda path: [
            int(p) for p in path.rsplit("/", 1)[1].split(".") if p.isdigit()
        ]
    )
    candidates += [
        os.path.join(prefix, "bin", f"python{version}")
        for prefix in reversed(installed)
    ]
    for interpreter in candidates:
        # A pyenv shim on PATH answers only where that version is selected.
        if interpreter and _runs(interpreter, version):
            return interpreter
    raise SystemExit(
        f"No Python {version} found: pass --python {version}=/path/to/python{version} "
        f"or set {variable}."
    )


def snapshot_checkout() -> str:
    """A copy of the working tree under `.matrix/checkout`: the tests run from
    it, so edits made while the run goes on do not reach it."""
    copy = os.path.join(MATRIX_DIR, "checkout")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(
        REPOSITORY,
        copy,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", ".matrix", "build", "*.egg-info", "__pycache__"
        ),
    )
    return copy


def _runs(interpreter: str, version: str) -> bool:
    """Whether `interpreter` starts and is Python `version`."""
    try:
        done = subprocess.run(
            [interpreter, "-c", "import platform; print(platform.python_version())"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError:
        return False
    return done.returncode == 0 and done.stdout.startswith(version + ".")


def build_wheel(checkout: str) -> str:
    """Build the wheel (and sdist) of this checkout; returns the wheel's path."""
    dist = os.path.join(MATRIX_DIR, "dist")
    shutil.rmtree(dist, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, checkout],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    (wheel,) = glob.glob(os.path.join(dist, "*.whl"))
    return wheel


def _pip(python: str, arguments: list[str], env: dict[str, str], log) -> None:
    command = [python, "-m", "pip", "install", "-q", *arguments]
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    subprocess.run(command, check=True, env=env, stdout=log, stderr=log)


def installed_versions(python: str) -> dict[str, str]:
    """`{distribution name (lower case): version}` of an environment."""
    listing = subprocess.run(
        [python, "-m", "pip", "list", "--format=json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {item["name"].lower(): item["version"] for item in json.loads(listing)}


def run_set(matrix_set: MatrixSet, interpreter: str, wheel: str, checkout: str) -> dict:
    """Create the set's environment, install, run the subset; returns the result."""
    folder = os.path.join(MATRIX_DIR, matrix_set.name)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    venv = os.path.join(folder, "venv")
    python = os.path.join(venv, "bin", "python")
    env = dict(os.environ)
    if not matrix_set.use_machine_pip_config:
        env["PIP_CONFIG_FILE"] = os.devnull
    started = time.time()
    result = {"set": matrix_set.name, "description": matrix_set.description}
    with open(os.path.join(folder, "install.log"), "w") as log:
        subprocess.run([interpreter, "-m", "venv", venv], check=True)
        _pip(python, ["--upgrade", "pip"], env, log)
        _pip(python, list(matrix_set.user_stack), env, log)
        before = installed_versions(python)
        constraints = []
        if matrix_set.at_lower_bounds:
            pins = os.path.join(folder, "lower-bounds.txt")
            with open(pins, "w") as f:
                f.write("\n".join(lower_bound_pins()) + "\n")
            constraints = ["-c", pins]
        _pip(python, [*constraints, f"{wheel}[{EXTRAS}]", *TEST_TOOLS], env, log)
        if matrix_set.nightly:
            subprocess.run(
                [python, "-m", "pip", "uninstall", "-y", "keras", "keras-hub"],
                check=True,
                env=env,
                stdout=log,
                stderr=log,
            )
            _pip(python, ["--no-deps", "keras-nightly", "keras-hub-nightly"], env, log)
    after = installed_versions(python)
    result["install_s"] = round(time.time() - started)
    result["python"] = subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    result["versions"] = {name: after[name] for name in SHOWN if name in after}
    result["user_stack_changed"] = {
        name: [before[name], after.get(name)]
        for name in ("jax", "jaxlib", "torch")
        if name in before and before[name] != after.get(name)
    }
    result.update(run_tests(python, folder, env, checkout))
    with open(os.path.join(folder, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def run_tests(python: str, folder: str, env: dict[str, str], checkout: str) -> dict:
    """Run the subset from the checkout's copy in the set's environment."""
    env = dict(env, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    junit = os.path.join(folder, "junit.xml")
    started = time.time()
    with open(os.path.join(folder, "tests.log"), "w") as log:
        completed = subprocess.run(
            [
                python,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-n",
                "2",
                "--dist",
                "loadfile",
                f"--junitxml={junit}",
                *TEST_SUBSET,
            ],
            cwd=checkout,
            env=env,
            stdout=log,
            stderr=log,
        )
    with open(os.path.join(folder, "tests.log")) as f:
        text = f.read()
    counts = {
        kind: int(number)
        for number, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", text)
    }
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.MULTILINE)
    return {
        "tests_s": round(time.time() - started),
        "exit_code": completed.returncode,
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0)
        + counts.get("error", 0)
        + counts.get("errors", 0),
        "skipped": counts.get("skipped", 0),
        "failures": failures,
    }


def render() -> str:
    """COMPATIBILITY.md from the results under `.matrix/`."""
    results = []
    for name in matrix_sets():
        path = os.path.join(MATRIX_DIR, name, "result.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
    columns = ["set", "Python", *SHOWN, "user's JAX/PyTorch kept", "tests", "result"]
    lines = [
        "# Compatibility",
        "",
        "Generated by `bash dev.sh matrix` (`tools/compat_matrix.py`): each set is "
        "a fresh virtual environment where the user's JAX and PyTorch are "
        "installed first, then the wheel built from this checkout with the extras "
        f"`[{EXTRAS}]`; then {len(TEST_SUBSET)} test files that reach every "
        "Keras and JAX private the library uses run against it "
        "(`TEST_SUBSET` in the script).",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for result in results:
        versions = result["versions"]
        changed = result["user_stack_changed"]
        kept = (
            "yes"
            if not changed
            else "no: "
            + ", ".join(f"{name} {old} → {new}" for name, (old, new) in changed.items())
        )
        outcome = "pass" if result["exit_code"] == 0 else "FAIL"
        tests = f"{result['passed']} passed, {result['failed']} failed"
        if result["skipped"]:
            tests += f", {result['skipped']} skipped"
        row = [
            f"{result['set']}: {result['description']}",
            result["python"],
            *[versions.get(name, "–") for name in SHOWN],
            kept,
            tests,
            outcome,
        ]
        lines.append("| " + " | ".join(row) + " |")
    for result in results:
        if result["failures"]:
            lines += ["", f"Failures in `{result['set']}`:", ""]
            lines += [f"- `{failure}`" for failure in result["failures"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sets", nargs="*", help="sets to run (default: all)")
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="VERSION=PATH",
        help="interpreter for a Python version, e.g. 3.13=/usr/bin/python3.13",
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="only rewrite COMPATIBILITY.md from stored results",
    )
    args = parser.parse_args(argv)
    sets = matrix_sets()
    unknown = [name for name in args.sets if name not in sets]
    if unknown:
        parser.error(f"unknown set(s) {unknown}; choose from {sorted(sets)}")
    if not args.render:
        overrides = dict(item.split("=", 1) for item in args.python)
        chosen = [sets[name] for name in (args.sets or sets)]
        interpreters = {s.name: find_python(s.python, overrides) for s in chosen}
        os.makedirs(MATRIX_DIR, exist_ok=True)
        checkout = snapshot_checkout()
        wheel = build_wheel(checkout)
        for matrix_set in chosen:
            print(f"{matrix_set.name}: {interpreters[matrix_set.name]}", flush=True)
            result = run_set(matrix_set, interpreters[matrix_set.name], wheel, checkout)
            print(
                f"  {result['passed']} passed, {result['failed']} failed "
                f"(install {result['install_s']} s, tests {result['tests_s']} s)",
                flush=True,
            )
    with open(REPORT, "w") as f:
        f.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
