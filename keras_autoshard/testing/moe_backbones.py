"""KerasHub's MoE backbones at small configs, and what one plan of each
compiles to against KerasHub's own layout map.

Each class (one layer, 8 experts, top 2) is planned by `plan` on a 2x4
(data x model) mesh and one MSE/Adam training step compiled under the plan
and, where the class ships `get_layout_map`, under KerasHub's map
(`measure`). `tests/planner/test_moe_hub.py` and `benchmarks/moe_experts.py`
use the same configs.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from keras_autoshard import plan
from keras_autoshard.apply.jax.plan_distribution import PlanDistribution
from keras_autoshard.plans.sharding_plan import MeshSpec
from keras_autoshard.testing.compiled import compiled_report
from keras_autoshard.testing.reference_plans import (
    StrategyNotApplicable,
    keras_hub_layout_map,
)

MESH_2x4 = MeshSpec((2, 4), ("batch", "model"))
VOCAB, SEQ, HIDDEN, ROWS = 64, 8, 32, 8
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


def builder(name: str):
    """A function building a one-layer `name` backbone from `CONFIGS`."""

    def build() -> keras.Model:
        import keras_hub

        return getattr(keras_hub.models, name)(
            vocabulary_size=VOCAB, num_layers=1, **ATTENTION, **CONFIGS[name]
        )

    return build


def tokens(rows: int = ROWS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(0, VOCAB, (rows, SEQ)).astype("int32"),
        "padding_mask": np.ones((rows, SEQ), "int32"),
    }


def targets(rows: int = ROWS) -> np.ndarray:
    rng = np.random.default_rng(1)
    return rng.standard_normal((rows, SEQ, HIDDEN)).astype("float32")


@dataclasses.dataclass
class MoeRow:
    """One MoE backbone on one mesh.

    Attributes:
        model: The `keras_hub.models` class.
        mesh: e.g. "2x4".
        auto_bytes: Collective operand bytes per device, compiled auto plan.
        hub_bytes: The same under KerasHub's `get_layout_map`, or None.
        hub_note: Why there is no KerasHub figure ("" when there is one).
        auto_all_to_all: All-to-all count in the auto plan's train step.
        auto_all_reduce: All-reduce count in the auto plan's train step.
        expert_kernels: Stacked expert kernels found (experts-dim role).
        expert_placement: The plan's note on where the experts go.
        params_over_ideal: Parameter bytes on the fullest device ÷ ideal.
    """

    model: str
    mesh: str
    auto_bytes: int
    hub_bytes: int | None
    hub_note: str
    auto_all_to_all: int
    auto_all_reduce: int
    expert_kernels: int
    expert_placement: str
    params_over_ideal: float


def measure(name: str, mesh: MeshSpec = MESH_2x4) -> MoeRow:
    build, x, y = builder(name), tokens(), targets()
    auto_plan = plan(build, mesh, sample_input=x)
    auto = compiled_report(build, PlanDistribution(auto_plan), x, y)
    try:
        hub = compiled_report(build, keras_hub_layout_map(build, mesh), x, y)
        hub_bytes, hub_note = hub.train_step.operand_bytes(), ""
    except StrategyNotApplicable as reason:
        hub_bytes, hub_note = None, str(reason)
    experts = [v for v in auto_plan.variables if "experts" in v.roles]
    placement = [n for n in auto_plan.notes if "experts" in n.split(".")[0]]
    total = sum(v.total_bytes for v in auto_plan.variables)
    return MoeRow(
        model=name,
        mesh="x".join(map(str, mesh.shape)),
        auto_bytes=auto.train_step.operand_bytes(),
        hub_bytes=hub_bytes,
        hub_note=hub_note,
        auto_all_to_all=auto.train_step.count("all-to-all"),
        auto_all_reduce=auto.train_step.count("all-reduce"),
        expert_kernels=len(experts),
        expert_placement=placement[0] if placement else "no experts dim found",
        params_over_ideal=auto.parameter_bytes_per_device * mesh.device_count / total,
    )
