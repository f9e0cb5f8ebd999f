"""Hand-written Megatron plans on a (2, 4) mesh match the single-device model."""

import numpy as np
import pytest

from keras_autoshard import MeshSpec, PlanDistribution
from keras_autoshard.building import names_replayed_after
from keras_autoshard.plans.rules import plan_from_rules
from keras_autoshard.testing import zoo
from keras_autoshard.testing.reference_plans import keras_hub_megatron_plan
from tests.parity import check_parity

MESH = MeshSpec((2, 4), ("batch", "model"))

MLP_RULES = {
    "up/kernel": (None, "model"),
    "up/bias": ("model",),
    "down/kernel": ("model", None),
}


def mlp_plan():
    with names_replayed_after():
        model = zoo.build_mlp_block()
    return plan_from_rules(model.variables, MESH, MLP_RULES, batch_axis="batch")


def test_mlp_megatron_plan_matches_single_device_after_5_adam_steps():
    x, y = zoo.mlp_batch()
    check_parity(zoo.build_mlp_block, PlanDistribution(mlp_plan()), x, y)


def test_mlp_parameter_shards_are_the_sizes_the_plan_predicts():
    plan = mlp_plan()
    dist = PlanDistribution(plan)
    with dist.scope():
        model = zoo.build_mlp_block()
    for v in model.variables:
        expected = plan.variable(v.path).bytes_per_device(plan.mesh)
        sizes = {s.data.nbytes for s in v.value.addressable_shards}
        assert sizes == {expected}, v.path
    # up/kernel is cut 4 ways: 64 x 256 fp32 / 4.
    assert plan.variable("up/kernel").bytes_per_device(MESH) == 64 * 256 * 4 // 4


@pytest.mark.slow
def test_gpt2_megatron_plan_matches_single_device_after_5_adam_steps():
    with names_replayed_after():
        plan = keras_hub_megatron_plan(zoo.build_gpt2(), MESH)
    sharded_paths = [v.path for v in plan.variables if any(plan.variable(v.path).spec)]
    assert len(sharded_paths) == 4 * 10 + 1  # 10 per layer + token embedding
    x, y = zoo.gpt2_batch()
    _, sharded = check_parity(zoo.build_gpt2, PlanDistribution(plan), x, y)
    for v in sharded.variables:
        expected = plan.variable(v.path).bytes_per_device(plan.mesh)
        assert {s.data.nbytes for s in v.value.addressable_shards} == {expected}
    assert np.isfinite(sharded.get_weights()[0]).all()
