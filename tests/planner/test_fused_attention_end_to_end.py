"""cuDNN's fused attention in the planner's trace.

On an NVIDIA GPU, Keras's `ops.dot_product_attention` (every KerasHub
attention layer on JAX) traces `jax.nn.dot_product_attention` with
`implementation="cudnn"`: one primitive, `dot_product_attention_fwd_wrapper`,
inside a custom VJP, with empty operands for the features it does not use.
Planning such a model on a GPU machine once failed (a division by the bytes
of an empty operand) after an "unknown primitive" warning; a plan with a
GPU profile is what a user on that machine asks for first.

Here, on a CPU, the same trace is made by answering JAX's cuDNN version
probe (`check_cudnn_version`, which reads the installed cuDNN library) as a
GPU machine does; nothing of the planner or of Keras is replaced.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import keras
import pytest

from keras_autoshard import MeshSpec
from keras_autoshard.planner.plan_request import PlanRequest
from keras_autoshard.planner.planner import plan_with_cost

BATCH, SEQUENCE, WIDTH, HEADS, HEAD_WIDTH = 16, 128, 64, 8, 16
MESH = MeshSpec((2, 4), ("batch", "model"))
FUSED = "dot_product_attention_fwd_wrapper"


@contextlib.contextmanager
def cudnn_found():
    """JAX's cuDNN probe answering as on a GPU machine (cuDNN 9.10)."""
    from jax._src.cudnn import fused_attention_stablehlo

    with mock.patch.object(
        fused_attention_stablehlo, "check_cudnn_version", return_value=91000
    ):
        yield


class Attention(keras.layers.Layer):
    """Grouped-query attention through `jax.nn.dot_product_attention`."""

    def __init__(self, kv_heads, causal, implementation, **kwargs):
        super().__init__(**kwargs)
        self.kv_heads = kv_heads
        self.causal = causal
        self.implementation = implementation

    def build(self, input_shape):
        def projection(name, heads):
            return keras.layers.EinsumDense(
                "btd,dnh->btnh", (None, heads, HEAD_WIDTH), name=name
            )

        self.query = projection("query", HEADS)
        self.key = projection("key", self.kv_heads)
        self.value = projection("value", self.kv_heads)
        self.output_dense = keras.layers.EinsumDense(
            "btnh,nhd->btd", (None, WIDTH), name="output"
        )
        for layer in (self.query, self.key, self.value):
            layer.build(input_shape)
        self.output_dense.build((None, None, HEADS, HEAD_WIDTH))

    def call(self, x):
        query, key, value = (
            keras.ops.cast(layer(x), "bfloat16")
            for layer in (self.query, self.key, self.value)
        )
        attended = jax.nn.dot_product_attention(
            query, key, value, is_causal=self.causal, implementation=self.implementation
        )
        return self.output_dense(keras.ops.cast(attended, "float32"))


def builder(kv_heads=4, causal=False, implementation="cudnn"):
    def build():
        x = keras.Input((SEQUENCE, WIDTH), batch_size=BATCH)
        h = Attention(kv_heads, causal, implementation, name="attention")(x)
        h = keras.layers.Dense(4 * WIDTH, name="up")(h)
        return keras.Model(x, keras.layers.Dense(WIDTH, name="down")(h))

    return build


SAMPLE = jax.ShapeDtypeStruct((BATCH, SEQUENCE, WIDTH), jnp.float32)


def planned(kv_heads=4, causal=False, implementation="cudnn", **options):
    with cudnn_found():
        return plan_with_cost(
            builder(kv_heads, causal, implementation),
            MESH,
            SAMPLE,
            PlanRequest(**options),
        )


def specs(result):
    return {v.path: v.spec for v in result.plan.variables}


def test_the_trace_is_cudnns_fused_attention():
    # The premise of this file: the trace holds the GPU's primitive.
    with cudnn_found():
        model = builder()()
        jaxpr = jax.make_jaxpr(lambda x: model(x))(SAMPLE)
    assert FUSED in str(jaxpr)


@pytest.fixture(scope="module")
def grouped():
    return planned(kv_heads=4)


def test_fused_attention_is_cut_by_heads_megatron_style(grouped):
    found = specs(grouped)
    for name in ("query", "key", "value"):
        assert found[f"attention/{name}/kernel"] == (None, "model", None), name
    assert found["attention/output/kernel"] == ("model", None, None)
    assert found["up/kernel"] == (None, "model")
    assert found["down/kernel"] == ("model", None)
    unknown = dict(grouped.graph.unknown_primitives)
    assert FUSED not in unknown, unknown
    assert not any("dot_product_attention" in note for note in grouped.graph.notes)


def test_key_value_heads_that_do_not_divide_keep_the_query_heads_whole():
    # 2 key/value heads on a 4-way axis: cutting the 8 query heads alone
    # would pair each device's query heads with the wrong key/value heads.
    found = specs(planned(kv_heads=2))
    for name in ("query", "key", "value"):
        assert found[f"attention/{name}/kernel"][1] is None, name
    assert found["attention/output/kernel"][0] is None


def _reasons(result):
    return {c.unshardable_reason for c in result.graph.classes}


def test_a_causal_kernel_keeps_the_query_sequence_whole(grouped):
    reason = "query sequence of a causal or windowed fused attention"
    assert not any(reason in (r or "") for r in _reasons(grouped))
    assert any(reason in (r or "") for r in _reasons(planned(causal=True)))


def test_the_estimate_keeps_no_attention_scores(grouped):
    # XLA's attention keeps the (B, N, T, S) probabilities for the backward
    # pass; cuDNN keeps the query, key, value, output and one float32
    # statistic per (B, N, T). Per device on 2x4 (batch and heads cut):
    xla = planned(kv_heads=4, implementation="xla")
    scores = BATCH * HEADS * SEQUENCE * SEQUENCE * 2 // 8  # bfloat16
    statistics = BATCH * HEADS * SEQUENCE * 4 // 8
    fused_kept = grouped.plan.estimate.activation_bytes
    xla_kept = xla.plan.estimate.activation_bytes
    assert xla_kept - fused_kept >= scores - statistics, (xla_kept, fused_kept)
    # Both count the same contractions: the fused kernel's two products.
    assert grouped.plan.estimate.compute_flops == pytest.approx(
        xla.plan.estimate.compute_flops, rel=1e-6
    )


def test_a_gpu_profile_plans_a_fused_attention_model():
    # The first request on a GPU machine: plan for its profile. Its peak
    # budget once divided by the bytes of the kernel's empty operands.
    result = planned(kv_heads=4, hardware="h100-80gb")
    estimate = result.plan.estimate
    assert estimate.compiler == "XLA:GPU"
    assert estimate.peak_bytes > 0 and estimate.step_time_s > 0
    assert specs(result)["attention/query/kernel"] == (None, "model", None)
