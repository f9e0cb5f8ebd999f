"""KerasHub's MoE backbones (small configs): they plan with expert
parallelism, train 5 Adam steps like one device on a 2x4 mesh, and the plan
moves no more bytes than KerasHub's own `get_layout_map` where one exists."""

import keras_hub
import numpy as np
import pytest

import keras_autoshard as ka
from benchmarks.strategies import keras_hub_layout_map
from keras_autoshard import PlanDistribution
from tests.parity import check_parity, compiled_report

MESH_2x4 = ka.MeshSpec((2, 4), ("batch", "model"))
VOCAB, SEQ, HIDDEN = 64, 8, 32
ATTENTION = dict(num_query_heads=8, num_key_value_heads=4, hidden_dim=HIDDEN)
CONFIGS = {
    "MixtralBackbone": dict(intermediate_dim=64, num_experts=8, top_k=2),
    "QwenMoeBackbone": dict(
        intermediate_dim=64,
        moe_intermediate_dim=16,
        shared_expert_intermediate_dim=32,
        num_experts=8,
        top_k=2,
    ),
    "Qwen3MoeBackbone": dict(
        intermediate_dim=64, moe_intermediate_dim=16, num_experts=8, top_k=2
    ),
    "GptOssBackbone": dict(intermediate_dim=64, num_experts=8, top_k=2),
}


def builder(name):
    def build():
        return getattr(keras_hub.models, name)(
            vocabulary_size=VOCAB, num_layers=1, **ATTENTION, **CONFIGS[name]
        )

    return build


def tokens(rows=8):
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(0, VOCAB, (rows, SEQ)).astype("int32"),
        "padding_mask": np.ones((rows, SEQ), "int32"),
    }


def targets(rows=8):
    return (
        np.random.default_rng(1).standard_normal((rows, SEQ, HIDDEN)).astype("float32")
    )


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
    build, x, y = builder(name), tokens(), targets()
    auto = ka.plan(build, MESH_2x4, sample_input=x)
    hub = keras_hub_layout_map(build, MESH_2x4)
    auto_report = compiled_report(build, PlanDistribution(auto), x, y)
    hub_report = compiled_report(build, hub, x, y)
    auto_bytes = auto_report.train_step.operand_bytes()
    hub_bytes = hub_report.train_step.operand_bytes()
    assert auto_bytes <= hub_bytes, (auto_bytes, hub_bytes)
