"""Real-size models described by their configs, planned for real GPUs.

A `RealSizeRow` is a KerasHub backbone class with the constructor arguments
of a published model, a mesh and a global batch: built (at any depth, under
`POLICY`) and fed shapes only, never weights; `plan_row` plans it at full
depth for `TARGET`'s GPUs. `tokens_per_s_per_gpu` turns an estimated step
time into the throughput published figures are given in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

TARGET = "h100-80gb"
POLICY = "mixed_bfloat16"

TORCHTITAN = (
    "torchtitan's docs/performance.md, tables 1, 4 and 5 (torchtitan 9dec370, "
    "2024-12-26; H100s with 96 GB HBM2e at 500 W, Llama-3.1 with its 128,256-"
    "token vocabulary, 8,192 tokens per sequence)"
)


@dataclasses.dataclass(frozen=True)
class Published:
    """A measured throughput to set the estimate against.

    Args:
        tokens_per_s_per_gpu: The figures' range `(low, high)` (one figure
            twice for one figure).
        configuration: What was measured, in words.
        source: Where it was published.
    """

    tokens_per_s_per_gpu: tuple[float, float]
    configuration: str
    source: str = TORCHTITAN


@dataclasses.dataclass(frozen=True)
class RealSizeRow:
    """One real-size model on one mesh.

    Args:
        name: The row's name (`--rows NAME`).
        hub_class: The KerasHub backbone class.
        config: Its constructor's arguments (`num_layers` the full depth).
        mesh: `(batch, model)` mesh shape.
        batch: Global batch (sequences or images).
        seq: Tokens per example (an image's: its patches).
        published: A measured throughput for this model and GPU count.
    """

    name: str
    hub_class: str
    config: dict[str, Any]
    mesh: tuple[int, int]
    batch: int
    seq: int
    published: Published | None = None

    @property
    def num_layers(self) -> int:
        return int(self.config["num_layers"])

    @property
    def device_count(self) -> int:
        return self.mesh[0] * self.mesh[1]

    @property
    def is_image_model(self) -> bool:
        return "image_shape" in self.config

    def builder(self, num_layers: int | None = None) -> Callable[[], Any]:
        """A function building the backbone (at `num_layers`, default the
        full depth) under `POLICY`, as these models are trained."""
        kwargs = dict(self.config, dtype=POLICY)
        if num_layers is not None:
            kwargs["num_layers"] = num_layers
        hub_class = self.hub_class

        def build():
            import keras_hub

            return getattr(keras_hub.models, hub_class)(**kwargs)

        return build

    def sample_input(self):
        """One global batch of inputs as `jax.ShapeDtypeStruct`s."""
        import jax

        if self.is_image_model:
            return jax.ShapeDtypeStruct(
                (self.batch, *self.config["image_shape"]), "float32"
            )
        tokens = jax.ShapeDtypeStruct((self.batch, self.seq), np.int32)
        return {"token_ids": tokens, "padding_mask": tokens}

    def sample_target(self):
        """The MSE target: the backbone's output shape, float32."""
        import jax

        width = self.config["hidden_dim"]
        return jax.ShapeDtypeStruct((self.batch, self.seq, width), np.float32)


def tokens_per_s_per_gpu(
    batch: int, tokens_per_example: int, step_time_s: float, device_count: int
) -> float:
    """Tokens each GPU trains on per second.

    `step_time_s` is the estimate's time of one optimizer step over the
    whole global batch: the planner traces the global batch, so its FLOPs
    are every micro-batch's together, and it counts the data-axis
    reductions once per micro-batch. Under gradient accumulation no
    division by the micro-batch count is due.

    Example:

    ```python
    tokens_per_s_per_gpu(256, 4096, 4.0, 256)  # 1024.0
    ```
    """
    return batch * tokens_per_example / (step_time_s * device_count)


def plan_row(row: RealSizeRow):
    """`row` planned at its full depth for `TARGET`, shapes only.

    Args:
        row: The model, mesh and batch.

    Returns:
        The `PlanningResult` (its `plan` and `cost`).

    Example:

    ```python
    sharding_plan = plan_row(row).plan
    ```
    """
    from keras_autoshard.planner.plan_request import PlanRequest
    from keras_autoshard.planner.planner import plan_with_cost
    from keras_autoshard.plans.sharding_plan import MeshSpec

    return plan_with_cost(
        row.builder(),
        MeshSpec(row.mesh, ("batch", "model")),
        row.sample_input(),
        PlanRequest(hardware=TARGET),
    )
