"""KerasHub's MoE backbones (small configs): they plan with expert
parallelism, train 5 Adam steps like one device on a 2x4 mesh, and the plan
moves no more bytes than KerasHub's own `get_layout_map` where one exists."""

import pytest

import keras_autoshard as ka
from keras_autoshard.testing.moe_backbones import (
    CONFIGS,
    MESH_2x4,
    builder,
    measure,
    targets,
    tokens,
)
from tests.parity import check_parity


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_backbone_trains_5_steps_like_one_device_with_experts_cut(name):
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    check_parity(builder(name), dist, tokens(), targets(), steps=5)
    plan = dist.plan
    assert plan.batch_axis == "batch"
    experts = [v for v in plan.variables if "experts" in v.roles]
    assert experts, f"{name}: no expert kernels found"
    assert all(v.spec[v.roles.index("experts")] == "model" for v in experts)
    assert any(n.startswith("Expert parallelism: 8 experts") for n in plan.notes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["QwenMoeBackbone", "Qwen3MoeBackbone"])
def test_moe_plan_moves_no_more_bytes_than_keras_hub_layout_map(name):
    row = measure(name)
    assert row.hub_bytes is not None, row.hub_note
    assert row.auto_bytes <= row.hub_bytes, (row.auto_bytes, row.hub_bytes)
    assert row.expert_kernels > 0
    assert row.expert_placement.startswith("Expert parallelism: 8 experts")
