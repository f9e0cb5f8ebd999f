"""The wheel works alone: built from this checkout (sdist first, the wheel
from the sdist), installed into a fresh virtual environment with no extras
(JAX on CPU comes with the package) at the lock's versions, it imports from
site-packages and plans, with no source checkout on the path."""

import json
import os
import subprocess
import sys
import tarfile
import textwrap
import zipfile

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(REPOSITORY, "dev-lock.txt")

SMOKE_PLAN = textwrap.dedent(
    """
    import importlib.metadata
    import json
    import os

    os.environ["KERAS_BACKEND"] = "jax"
    import keras_autoshard as ka

    ka.simulate_devices(8)
    import keras
    import numpy as np

    inputs = keras.Input((16, 64))
    hidden = keras.layers.Dense(256, activation="gelu", name="up")(inputs)
    outputs = keras.layers.Dense(64, name="down")(hidden)
    model = keras.Model(inputs, outputs)
    plan = ka.plan(
        model,
        ka.MeshSpec((2, 4), ("batch", "model")),
        sample_input=np.zeros((8, 16, 64), "float32"),
    )
    print(json.dumps({
        "module": ka.__file__,
        "version": ka.__version__,
        "distribution_version": importlib.metadata.version("keras-autoshard"),
        "specs": {v.path: list(v.spec) for v in plan.variables},
        "profile_bytes": ka.hardware_profile("h100-80gb").memory_budget_bytes,
    }))
    """
)


def _run(command, **kwargs):
    completed = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert completed.returncode == 0, (
        f"{' '.join(map(str, command))} exited {completed.returncode}:\n"
        f"{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
    )
    return completed.stdout


def test_built_wheel_installs_alone_and_plans_without_the_checkout(tmp_path):
    dist = tmp_path / "dist"
    _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, REPOSITORY]
    )
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        top_levels = {name.split("/")[0] for name in archive.namelist()}
    assert {name for name in top_levels if not name.endswith(".dist-info")} == {
        "keras_autoshard"
    }
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[-1] for name in archive.getnames()}
    assert {"README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml"} <= names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", "-c", LOCK, str(wheel)])

    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "KERAS_BACKEND", "XLA_FLAGS")
    }
    output = _run([python, "-c", SMOKE_PLAN], cwd=tmp_path, env=env)
    smoke = json.loads(output.strip().splitlines()[-1])
    assert smoke["module"].startswith(str(venv)), smoke["module"]
    assert smoke["version"] == smoke["distribution_version"]
    # A 16-token MLP block planned on 2x4: the up projection column-parallel,
    # the down projection row-parallel over "model".
    assert smoke["specs"]["up/kernel"] == [None, "model"]
    assert smoke["specs"]["down/kernel"] == ["model", None]
    assert smoke["profile_bytes"] > 70 * 2**30
    command_line = str(venv / "bin" / "keras-autoshard")
    printed = _run([command_line, "--version"], cwd=tmp_path, env=env)
    assert printed.split() == ["keras-autoshard", smoke["version"]]


def test_library_declares_ranges_that_the_lock_satisfies():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    with open(os.path.join(REPOSITORY, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["requires-python"] == ">=3.11"
    with open(LOCK) as f:
        pins = [line.strip().split("==") for line in f if "==" in line]
    locked = {canonicalize_name(name): version for name, version in pins}
    declared = list(project["dependencies"])
    for extra, requirements in project["optional-dependencies"].items():
        if extra not in ("dev", "cuda12", "tpu", "gpu-compile"):
            declared += requirements
    for text in declared:
        requirement = Requirement(text)
        operators = {spec.operator for spec in requirement.specifier}
        assert operators == {">=", "<"}, f"{text}: a range, from >= to <"
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{name} is not pinned in dev-lock.txt"
        assert requirement.specifier.contains(locked[name]), (
            f"dev-lock.txt pins {name}=={locked[name]}, outside {text}"
        )
