"""The public API: the names the top level exports and the modules of the
API (`building`, `distributed`), the names it used to export and the old
`keras_autoshard.collectives` (a `DeprecationWarning` naming the new
spelling, the same object), and the one checkpoint callback for either
backend."""

import importlib
import inspect
import pathlib
import re

import keras
import pytest

import keras_autoshard as ka
from keras_autoshard import collectives as collectives_front

PUBLIC = [
    "AutoShardDistribution",
    "HardwareProfile",
    "MeshSpec",
    "PlanDistribution",
    "ShardedCheckpoint",
    "ShardingPlan",
    "TensorParallel",
    "building",
    "compile_for_target",
    "distributed",
    "errors",
    "from_preset",
    "hardware_profile",
    "inspect_compiled",
    "load_model_sharded",
    "load_weights_sharded",
    "make_device_mesh",
    "plan",
    "plan_from_rules",
    "rematerialize",
    "restore_checkpoint",
    "save_checkpoint",
    "save_safetensors",
    "simulate_devices",
    "types",
]
# Where the names the top level held before live now (their defining module).
HOMES = {
    "keras_autoshard.building.build_abstract": "keras_autoshard.trace.tracer",
    "keras_autoshard.building.names_replayed_after": "keras_autoshard.trace.naming",
    "keras_autoshard.distributed.initialize": "keras_autoshard.runtime.cluster",
    "keras_autoshard.distributed.resolve_cluster": "keras_autoshard.runtime.cluster",
    "keras_autoshard.distributed.process_batch_rows": (
        "keras_autoshard.runtime.cluster"
    ),
    "keras_autoshard.ShardedCheckpoint.complete_steps": (
        "keras_autoshard.checkpoint.steps"
    ),
    **{
        f"keras_autoshard.distributed.{name}": "keras_autoshard.runtime.collectives"
        for name in (
            "all_gather",
            "all_reduce",
            "broadcast",
            "copy_to_parallel",
            "reduce_from_parallel",
            "reduce_scatter",
            "scatter",
        )
    },
}


def _spelled(spelling: str):
    """The object a dotted public spelling names, attribute by attribute."""
    value = ka
    for part in spelling.split(".")[1:]:
        value = getattr(value, part)
    return value


def test_the_public_names():
    assert ka.__all__ == PUBLIC
    assert len(ka.__all__) <= 25
    for name in PUBLIC:
        assert getattr(ka, name) is not None


@pytest.mark.parametrize("spelling", sorted(HOMES))
def test_a_name_in_a_module_of_the_api_is_its_defining_modules_object(spelling):
    name = spelling.rsplit(".", 1)[1]
    defined = getattr(importlib.import_module(HOMES[spelling]), name)
    assert _spelled(spelling) is defined


def test_the_modules_of_the_api_list_what_they_hold():
    assert ka.building.__all__ == ["build_abstract", "names_replayed_after"]
    assert set(ka.distributed.__all__) == {
        spelling.rsplit(".", 1)[1]
        for spelling in HOMES
        if spelling.startswith("keras_autoshard.distributed.")
    }
    with pytest.raises(AttributeError, match="no attribute 'plan'"):
        ka.distributed.plan  # noqa: B018


@pytest.mark.parametrize("name", sorted(ka._MOVED))
def test_a_moved_name_warns_with_its_new_spelling_and_is_the_same_object(name):
    module_name, now = ka._MOVED[name]
    with pytest.warns(DeprecationWarning, match=re.escape(now)) as caught:
        value = getattr(ka, name)
    # The warning points at the caller, not at the package.
    assert caught[0].filename == __file__
    assert value is getattr(importlib.import_module(module_name), name)
    assert name not in ka.__all__
    if now in HOMES:  # the new spelling names the same object
        assert _spelled(now) is value


@pytest.mark.parametrize("name", sorted(collectives_front._MOVED))
def test_a_collective_of_the_old_module_warns_and_is_the_same_object(name):
    now = collectives_front._MOVED[name]
    with pytest.warns(DeprecationWarning, match=re.escape(now)) as caught:
        value = getattr(collectives_front, name)
    assert caught[0].filename == __file__
    assert value is _spelled(now)


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


def test_every_public_name_is_documented_with_an_example():
    undocumented = [
        name
        for name in ka.__all__
        if "Example:" not in (inspect.getdoc(getattr(ka, name)) or "")
    ]
    assert undocumented == []
