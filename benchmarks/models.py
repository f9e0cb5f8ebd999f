"""Benchmark models, their batches and their Megatron communication minimum.

Each entry of `MODELS` is a `ModelCase`: a builder (from config, no
downloads), a batch function giving `(x, y)` with `y` random targets of the
output's shape (the loss is MSE), and a function giving the analytic Megatron
minimum of per-device collective bytes in one training step on a mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np

from keras_autoshard import MeshSpec
from keras_autoshard.plans.mesh import DATA_AXIS
from keras_autoshard.testing import zoo
from keras_autoshard.testing.reference_plans import handwritten_plan

FP32_BYTES = 4
BATCH = 8
SEQ = 128

MLP_HIDDEN = 512

GPT2_CONFIG = zoo.BENCHMARK_GPT2_CONFIG


@dataclasses.dataclass(frozen=True)
class MegatronMinimum:
    """Per-device collective bytes of one ideal Megatron training step.

    Args:
        activation_bytes: Activation all-reduces over the model axis
            (forward and backward).
        gradient_bytes: The gradient all-reduce over the data axis (the
            per-device parameter bytes of the Megatron plan).
        formula: How `activation_bytes` was counted, for the report.
    """

    activation_bytes: int
    gradient_bytes: int
    formula: str

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.gradient_bytes


class ModelCase(NamedTuple):
    """One benchmark model.

    Args:
        build: Builds the model (same variable paths on every call after a
            `names_replayed_after()` build).
        batch: Returns `(x, y)` for one global batch.
        megatron_minimum: `(built model, mesh) -> MegatronMinimum`.
        description: One line for the report.
    """

    build: Callable[[], keras.Model]
    batch: Callable[[], tuple[Any, np.ndarray]]
    megatron_minimum: Callable[[keras.Model, MeshSpec], MegatronMinimum]
    description: str = ""


def build_mlp_block() -> keras.Model:
    """The zoo's MLP block at h = 512 (LayerNorm → Dense(4h) → Dense(h))."""
    return zoo.build_mlp_block(MLP_HIDDEN, SEQ)


def mlp_batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs and targets of shape (batch, seq, hidden)."""
    return zoo.mlp_batch(MLP_HIDDEN, SEQ, BATCH, seed)


def mlp_megatron_minimum(model: keras.Model, mesh: MeshSpec) -> MegatronMinimum:
    """One forward and one backward all-reduce of the block output + grad sync."""
    activation = _activation_bytes(mesh, MLP_HIDDEN)
    return MegatronMinimum(
        activation_bytes=2 * activation,
        gradient_bytes=handwritten_plan(model, mesh).bytes_per_device(),
        formula="2 × (b/data)·s·h·4",
    )


def build_gpt2() -> keras.Model:
    """The zoo's GPT-2 backbone at the benchmark size."""
    return zoo.build_gpt2(**GPT2_CONFIG)


def gpt2_batch(seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Random token ids, a full padding mask and random hidden-state targets."""
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, GPT2_CONFIG["vocabulary_size"], (BATCH, SEQ))
    x = {
        "token_ids": token_ids.astype("int32"),
        "padding_mask": np.ones((BATCH, SEQ), "int32"),
    }
    y = rng.standard_normal((BATCH, SEQ, GPT2_CONFIG["hidden_dim"]))
    return x, y.astype("float32")


def gpt2_megatron_minimum(model: keras.Model, mesh: MeshSpec) -> MegatronMinimum:
    """Per layer 2 forward + 2 backward activation all-reduces, + grad sync."""
    layers = GPT2_CONFIG["num_layers"]
    activation = _activation_bytes(mesh, GPT2_CONFIG["hidden_dim"])
    return MegatronMinimum(
        activation_bytes=layers * 4 * activation,
        gradient_bytes=handwritten_plan(model, mesh).bytes_per_device(),
        formula=f"{layers} layers × 4 × (b/data)·s·h·4",
    )


def _activation_bytes(mesh: MeshSpec, hidden: int) -> int:
    """Bytes of one per-device activation: (batch / data) × seq × hidden × 4."""
    return BATCH // mesh.axis_size(DATA_AXIS) * SEQ * hidden * FP32_BYTES


MODELS: dict[str, ModelCase] = {
    "mlp_block": ModelCase(
        build=build_mlp_block,
        batch=mlp_batch,
        megatron_minimum=mlp_megatron_minimum,
        description=(
            f"LayerNorm → Dense({4 * MLP_HIDDEN}, tanh) → Dense({MLP_HIDDEN}) → "
            f"residual; batch {BATCH} × seq {SEQ}"
        ),
    ),
    "gpt2": ModelCase(
        build=build_gpt2,
        batch=gpt2_batch,
        megatron_minimum=gpt2_megatron_minimum,
        description=(
            "KerasHub GPT2Backbone from config: "
            f"{GPT2_CONFIG['num_layers']} layers, hidden {GPT2_CONFIG['hidden_dim']},"
            f" {GPT2_CONFIG['num_heads']} heads, intermediate "
            f"{GPT2_CONFIG['intermediate_dim']}, vocabulary "
            f"{GPT2_CONFIG['vocabulary_size']}; batch {BATCH} × seq {SEQ}"
        ),
    ),
}
