"""Two variables may share a Keras path (equally named layers in two
sub-models): the plan holds both, round-trips through JSON, applies, and the
sharded model matches one device."""

import json

import keras
import numpy as np
import pytest

import keras_autoshard as ka
from tests.parity import check_parity

MESH_2x4 = ka.MeshSpec((2, 4), ("batch", "model"))


def _tower(width, name):
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(width, activation="relu", name="proj")(inputs)
    outputs = keras.layers.Dense(16, name="out")(hidden)
    return keras.Model(inputs, outputs, name=name)


def two_towers():
    """Two sub-models whose layers have the same names ("proj", "out"): their
    variables share paths `proj/kernel`, `out/kernel`, ... ."""
    inputs = keras.Input((16,), name="features")
    first = _tower(64, "encoder")(inputs)
    second = _tower(32, "decoder")(first)
    return keras.Model(inputs, second)


def _batch():
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((8, 16)).astype("float32"),
        rng.standard_normal((8, 16)).astype("float32"),
    )


def test_the_model_really_repeats_paths():
    paths = [v.path for v in two_towers().variables]
    assert len(paths) != len(set(paths)), paths


def test_plan_holds_every_variable_of_repeated_paths_and_round_trips(tmp_path):
    x, _ = _batch()
    plan = ka.plan(two_towers, MESH_2x4, sample_input=x)
    keys = [v.path for v in plan.variables]
    assert len(keys) == len(two_towers().variables) == len(set(keys))
    assert plan.variable("proj/kernel#0").shape == (16, 64)
    assert plan.variable("proj/kernel#1").shape == (16, 32)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert ka.ShardingPlan.load(str(path)) == plan
    saved = {entry["path"] for entry in json.loads(path.read_text())["variables"]}
    assert {"proj/kernel#0", "proj/kernel#1", "out/kernel#0", "out/kernel#1"} <= saved


def test_repeated_paths_apply_and_train_like_one_device():
    x, y = _batch()
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    _, sharded = check_parity(two_towers, dist, x, y, steps=3)
    by_shape = {tuple(v.shape): v for v in sharded.trainable_variables}
    for key in ("proj/kernel#0", "proj/kernel#1"):
        entry = dist.plan.variable(key)
        shards = by_shape[entry.shape].value.addressable_shards
        assert {s.data.nbytes for s in shards} == {entry.bytes_per_device(MESH_2x4)}


def _plan_with_specs(first, second):
    variables = [
        ka.types.VariableSharding("proj/kernel#0", (16, 64), "float32", first),
        ka.types.VariableSharding("proj/kernel#1", (16, 32), "float32", second),
    ]
    return ka.ShardingPlan(mesh=MESH_2x4, variables=tuple(variables))


def test_layout_map_holds_repeated_paths_that_share_a_spec():
    plan = _plan_with_specs((None, "model"), (None, "model"))
    layout_map = plan.to_layout_map(ka.make_device_mesh(MESH_2x4))
    assert tuple(layout_map["proj/kernel"].axes) == (None, "model")


def test_layout_map_refuses_repeated_paths_with_different_specs():
    plan = _plan_with_specs((None, "model"), ("model", None))
    with pytest.raises(ka.errors.PlanError, match="LayoutMap keys layouts by path"):
        plan.to_layout_map(ka.make_device_mesh(MESH_2x4))
