"""The public API: the names the top level exports, the names it used to
export (a `DeprecationWarning` naming the new spelling, the same object),
and the one checkpoint callback for either backend."""

import importlib
import pathlib
import re

import keras
import pytest

import keras_autoshard as ka

PUBLIC = [
    "AutoShardDistribution",
    "HardwareProfile",
    "MeshSpec",
    "PlanDistribution",
    "ShardedCheckpoint",
    "ShardingPlan",
    "TensorParallel",
    "build_abstract",
    "compile_for_target",
    "complete_steps",
    "errors",
    "from_preset",
    "hardware_profile",
    "initialize",
    "inspect_compiled",
    "load_model_sharded",
    "load_weights_sharded",
    "make_device_mesh",
    "names_replayed_after",
    "plan",
    "plan_from_rules",
    "process_batch_rows",
    "rematerialize",
    "resolve_cluster",
    "restore_checkpoint",
    "save_checkpoint",
    "save_safetensors",
    "simulate_devices",
    "types",
]


def test_the_public_names():
    assert ka.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(ka, name) is not None


@pytest.mark.parametrize("name", sorted(ka._MOVED))
def test_a_moved_name_warns_with_its_new_spelling_and_is_the_same_object(name):
    module_name, now = ka._MOVED[name]
    with pytest.warns(DeprecationWarning, match=re.escape(now)) as caught:
        value = getattr(ka, name)
    # The warning points at the caller, not at the package.
    assert caught[0].filename == __file__
    assert value is getattr(importlib.import_module(module_name), name)
    assert name not in ka.__all__


def test_errors_and_types_are_modules_of_the_api():
    assert ka.errors.PlanError.__module__ == "keras_autoshard.errors"
    assert issubclass(ka.errors.PlanError, ka.errors.AutoShardError)
    for name in ka.types.__all__:
        assert isinstance(getattr(ka.types, name), type)


def test_the_package_uses_no_moved_name():
    """Inside the package a moved name would warn at a user (the suite
    fails on a DeprecationWarning raised from package code anyway)."""
    moved = "|".join(ka._MOVED)
    pattern = re.compile(rf"\b(ka|keras_autoshard)\.({moved})\b")
    root = pathlib.Path(ka.__file__).parent
    found = [
        f"{path.relative_to(root)}:{number}"
        for path in root.rglob("*.py")
        if path.name != "__init__.py" or path.parent != root
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found


def test_sharded_checkpoint_builds_the_backends_callback(tmp_path):
    from keras_autoshard.checkpoint.orbax_callback import ShardedOrbaxCheckpoint

    assert keras.backend.backend() == "jax"
    callback = ka.ShardedCheckpoint(
        tmp_path / "ckpt", save_freq=2, max_to_keep=3, metadata={"run": "a"}
    )
    assert type(callback) is ShardedOrbaxCheckpoint
    assert isinstance(callback, ka.ShardedCheckpoint)
    assert isinstance(callback, keras.callbacks.Callback)
    assert not isinstance(keras.callbacks.History(), ka.ShardedCheckpoint)
    # Keras's OrbaxCheckpoint's own options pass through.
    best = ka.ShardedCheckpoint(tmp_path / "best", save_best_only=True, monitor="loss")
    assert best.save_best_only
