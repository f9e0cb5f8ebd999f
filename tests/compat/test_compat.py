"""Every Keras, JAX and PyTorch private the package uses is reached through
`keras_autoshard/compat/`, and the installed Keras, JAX and PyTorch still
have them."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

from keras_autoshard.compat import jax_private, keras_private, torch_private
from tools import python_source

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[2] / "keras_autoshard"
COMPAT_ROOT = PACKAGE_ROOT / "compat"

# Private attributes of Keras and JAX objects that only compat may touch.
PRIVATE_ATTRIBUTES = frozenset(
    {
        "_value",
        "_layout",
        "_direct_assign",
        "_initialize",
        "_initialize_layout",
        "_deferred_initialize",
        "_initializer",
        "_flatten_layers",
        "_symbolic_build",
        "_get_jax_state",
        "_get_state_sharding_spec",
        "_create_nested_dict",
        "_distribution_strategy",
        "_steps_per_epoch",
        "_cluster_types",
        "_backends",
        "_getframe",
        "_pg_registry",
    }
)
PRIVATE_MODULES = ("keras.src", "jax._src")


def test_the_installed_keras_has_every_private_the_package_uses():
    missing = keras_private.missing_privates()
    assert missing == [], "Keras privates missing: " + "; ".join(missing)


def test_the_installed_jax_has_every_private_the_package_uses():
    missing = jax_private.missing_privates()
    assert missing == [], "JAX privates missing: " + "; ".join(missing)


def test_the_installed_torch_has_every_private_the_package_uses():
    missing = torch_private.missing_privates()
    assert missing == [], "PyTorch privates missing: " + "; ".join(missing)


def test_a_meshs_process_groups_are_forgotten_through_compat():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
        assert mesh._pg_registry  # what the exit hook drops
        assert torch_private.forget_mesh_process_groups(mesh)
        assert mesh._pg_registry == {}
        assert not torch_private.forget_mesh_process_groups(None)  # collected
    finally:
        dist.destroy_process_group()


def test_the_keras_check_names_a_module_function_that_is_gone(monkeypatch):
    from keras.src.saving import saving_lib

    monkeypatch.delattr(saving_lib, "_save_state")
    missing = keras_private.missing_privates()
    assert missing == ["keras.src.saving.saving_lib._save_state"]


def test_the_keras_check_names_a_trainer_local_that_is_gone(monkeypatch):
    import keras

    def fit(self, x=None, y=None, **kwargs):  # no epoch_iterator, no state
        return None

    trainer = next(c for c in keras.Model.__mro__ if "fit" in vars(c))
    monkeypatch.setattr(trainer, "fit", fit)
    missing = keras_private.missing_privates()
    assert len(missing) == 1 and "'epoch_iterator', 'state'" in missing[0], missing


def test_the_jax_check_names_a_private_that_is_gone(monkeypatch):
    from jax._src import ad_checkpoint

    monkeypatch.delattr(ad_checkpoint, "saved_residuals")
    assert jax_private.missing_privates() == ["jax._src.ad_checkpoint.saved_residuals"]


def _outside_compat() -> list[pathlib.Path]:
    return [
        path
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if COMPAT_ROOT not in path.parents
    ]


def private_uses(source: str) -> list[str]:
    """Imports of `keras.src`/`jax._src` and reads or writes of Keras and
    JAX private attributes (also named as strings, as `getattr` takes them)
    in `source`."""
    found = []
    for node in ast.walk(python_source.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            modules = []
        for module in modules:
            if module.startswith(PRIVATE_MODULES):
                found.append(f"line {node.lineno}: imports {module}")
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRIBUTES:
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_the_private_scan_finds_private_uses():
    # The scanner itself must be able to fail.
    source = (
        "from keras.src import tree\n"
        "import jax._src.xla_bridge\n"
        "frame = sys._getframe(1)\n"
        "variable._value = None\n"
        "getattr(variable, '_layout', None)\n"
        "self.name = 'x'\n"
    )
    assert len(private_uses(source)) == 5


def test_only_compat_uses_keras_and_jax_privates():
    uses = {
        str(path.relative_to(PACKAGE_ROOT)): private_uses(path.read_text())
        for path in _outside_compat()
    }
    assert {path: found for path, found in uses.items() if found} == {}


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=PACKAGE_ROOT.parent,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_importing_compat_imports_no_keras_jax_or_torch():
    imported = _run(
        "import sys\n"
        "from keras_autoshard.compat import jax_private, keras_private, torch_private\n"
        "print(sorted({'keras', 'jax', 'torch', 'tensorflow'} & set(sys.modules)))"
    )
    assert imported == "[]"


def test_simulate_devices_asks_whether_jax_started_without_importing_it():
    imported = _run(
        "import sys\n"
        "from keras_autoshard import simulate_devices\n"
        "simulate_devices(2)\n"
        "print('jax' in sys.modules)"
    )
    assert imported == "False"
