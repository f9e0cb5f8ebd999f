"""ShardingPlan: value semantics, JSON, LayoutMap, summary and validation."""

import json
import re

import keras
import pytest

from keras_autoshard import (
    MeshSpec,
    PlanDistribution,
    ShardingPlan,
    make_device_mesh,
    plan_from_rules,
)
from keras_autoshard.building import names_replayed_after
from keras_autoshard.errors import PlanError
from keras_autoshard.plans.sharding_plan import ActivationLayout
from keras_autoshard.testing import zoo
from keras_autoshard.types import VariableSharding

MESH = MeshSpec((2, 4), ("batch", "model"))


def small_plan(**changes) -> ShardingPlan:
    variables = (
        VariableSharding(
            "up/kernel", (64, 256), "float32", (None, "model"), ("embed", "mlp")
        ),
        VariableSharding("up/bias", (256,), "float32", ("model",), ("mlp",)),
        VariableSharding("down/kernel", (256, 64), "float32", ("model", None)),
    )
    fields = dict(
        mesh=MESH,
        variables=variables,
        batch_axis="batch",
        activations=(ActivationLayout("up/output", ("batch", None, "model")),),
        notes=("a note",),
    )
    fields.update(changes)
    return ShardingPlan(**fields)


def test_plan_is_a_hashable_value_independent_of_variable_order():
    plan = small_plan()
    shuffled = small_plan(variables=tuple(reversed(plan.variables)))
    assert plan == shuffled
    assert hash(plan) == hash(shuffled)
    assert [v.path for v in plan.variables] == sorted(v.path for v in plan.variables)


def test_json_round_trip_is_exact_and_stable(tmp_path):
    plan = small_plan()
    text = plan.to_json()
    assert ShardingPlan.from_json(text) == plan
    assert ShardingPlan.from_json(text).to_json() == text
    data = json.loads(text)
    assert data["format"] == "keras-autoshard/sharding-plan"
    assert data["version"] == 1
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert ShardingPlan.load(str(path)) == plan


def test_json_of_another_version_is_refused_with_the_version_named():
    data = small_plan().to_dict()
    data["version"] = 99
    with pytest.raises(PlanError, match="version 99"):
        ShardingPlan.from_dict(data)


def test_bytes_per_device_follow_the_specs():
    plan = small_plan()
    # up/kernel and down/kernel cut 4 ways, up/bias cut 4 ways.
    assert plan.bytes_per_device() == (64 * 256 * 4 * 2 + 256 * 4) // 4
    assert plan.total_bytes() == 64 * 256 * 4 * 2 + 256 * 4


def test_layout_map_gives_exact_layouts_and_nothing_for_other_paths():
    device_mesh = make_device_mesh(MESH)
    layout_map = small_plan().to_layout_map(device_mesh)
    assert tuple(layout_map["up/kernel"].axes) == (None, "model")
    assert tuple(layout_map["up/output"].axes) == ("batch", None, "model")
    # Exact paths only: a path that merely contains a planned one gets nothing.
    assert layout_map["block/up/kernel"] is None
    assert all(re.escape(k) == k or "\\" in k for k in layout_map)


def test_layout_map_for_other_mesh_shape_is_refused():
    other = make_device_mesh(MeshSpec((4, 2), ("batch", "model")))
    with pytest.raises(PlanError, match="batch=2 x model=4"):
        small_plan().to_layout_map(other)


def test_summary_lists_every_variable_with_bytes_and_totals():
    text = small_plan().summary()
    for path in ("up/kernel", "up/bias", "down/kernel"):
        assert path in text
    assert "(-, model)" in text
    assert "(embed, mlp)" in text
    assert "16.00 KiB" in text  # up/kernel per device: 64*256*4/4
    assert "a note" in text


def _mlp():
    with names_replayed_after():
        return zoo.build_mlp_block()


def test_validate_accepts_a_plan_made_for_the_model():
    model = _mlp()
    plan = plan_from_rules(
        model.variables, MESH, {"up/kernel": (None, "model")}, batch_axis="batch"
    )
    plan.validate(model)


def test_validate_reports_non_dividing_dim_with_sizes_and_fix():
    model = _mlp()
    base = plan_from_rules(model.variables, MESH, {}, batch_axis="batch")
    bad = base.replace_specs({"up/kernel": ("model", None)})
    bad = ShardingPlan(
        mesh=MeshSpec((2, 3), ("batch", "model")),
        variables=bad.variables,
        batch_axis="batch",
    )
    with pytest.raises(PlanError) as error:
        bad.validate(model)
    message = str(error.value)
    assert "up/kernel: dim 0 has size 64" in message
    assert "'model' of size 3" in message
    assert "Replicate that dim" in message


def test_validate_reports_unknown_axis_and_axis_used_twice():
    model = _mlp()
    base = plan_from_rules(model.variables, MESH, {}, batch_axis="batch")
    bad = base.replace_specs(
        {"up/kernel": ("tensor", None), "down/kernel": ("model", "model")}
    )
    with pytest.raises(PlanError) as error:
        bad.validate(model)
    message = str(error.value)
    assert "up/kernel: dim 0 names mesh axis 'tensor', which does not exist" in message
    assert "down/kernel: mesh axis 'model' shards both dim 0 and dim 1" in message


def test_validate_reports_variable_missing_from_plan():
    model = _mlp()
    full = plan_from_rules(model.variables, MESH, {}, batch_axis="batch")
    partial = ShardingPlan(
        mesh=MESH,
        batch_axis="batch",
        variables=tuple(v for v in full.variables if v.path != "down/bias"),
    )
    with pytest.raises(PlanError, match=r"down/bias: variable of shape \(64,\) is not"):
        partial.validate(model)


def test_validate_recognises_a_plan_for_another_model():
    model = _mlp()
    with names_replayed_after():
        other = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(3, name="a"),
                keras.layers.Dense(2, name="b"),
            ]
        )
    plan = plan_from_rules(other.variables, MESH, {}, batch_axis="batch")
    with pytest.raises(PlanError, match="for another model"):
        plan.validate(model)


def test_validate_reports_shape_mismatch():
    model = _mlp()
    plan = plan_from_rules(model.variables, MESH, {}, batch_axis="batch")
    entries = tuple(
        VariableSharding(v.path, (128, 256), v.dtype, (None, None))
        if v.path == "up/kernel"
        else v
        for v in plan.variables
    )
    bad = ShardingPlan(mesh=MESH, variables=entries, batch_axis="batch")
    with pytest.raises(PlanError, match=r"up/kernel: the plan has shape \(128, 256\)"):
        bad.validate(model)


def test_rule_matching_nothing_is_an_error():
    model = _mlp()
    with pytest.raises(PlanError, match="match no variable"):
        plan_from_rules(
            model.variables,
            MESH,
            {".*attention.*": (None, "model")},
            batch_axis="batch",
        )


def test_variable_matching_two_rules_is_an_error():
    model = _mlp()
    with pytest.raises(PlanError, match="matches several rules"):
        plan_from_rules(
            model.variables,
            MESH,
            {"up/.*": (None, "model"), ".*/kernel": (None, None)},
            batch_axis="batch",
        )


def test_distribution_refuses_trainable_variable_missing_from_plan():
    model = _mlp()
    full = plan_from_rules(model.variables, MESH, {}, batch_axis="batch")
    partial = ShardingPlan(
        mesh=MESH,
        batch_axis="batch",
        variables=tuple(v for v in full.variables if v.path != "up/kernel"),
    )
    with PlanDistribution(partial).scope():
        with pytest.raises(PlanError, match="'up/kernel'.*not in the sharding plan"):
            zoo.build_mlp_block()


def test_distribution_refuses_batch_that_does_not_split():
    dist = PlanDistribution(small_plan())
    with pytest.raises(PlanError, match="Batch of size 3"):
        dist.get_data_layout((3, 16))
    assert tuple(dist.get_data_layout((4, 16)).axes) == ("batch", None)


def test_mesh_needing_other_device_count_is_refused():
    with pytest.raises(PlanError, match="needs 6 devices but 8"):
        make_device_mesh(MeshSpec((2, 3), ("batch", "model")))
