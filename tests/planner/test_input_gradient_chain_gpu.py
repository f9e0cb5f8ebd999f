"""A layer's input-gradient chain before its weight gradients on XLA:GPU
(`split_k.split_sums_of_several_products`): where a layer's largest
backward buffer is the input gradient of an activation several of its
products read, split in partials, XLA:GPU (with memory free) forms that
chain before the layer's weight-gradient products, so the estimate holds
none of the layer's own gradients at that stage. Checked on gated blocks
written here (a norm read by a gate and an up projection, 8 x 64 tokens,
256 -> 1024 -> 256), compiled deviceless for 8 H100s on 2x4."""

import functools

import jax
import keras
import numpy as np

import keras_autoshard as ka
from benchmarks.peak_buffers import compiled_with_dump

BATCH, TOKENS, WIDTH, HIDDEN, OUT = 8, 64, 256, 1024, 16
MESH_2x4 = ka.MeshSpec((2, 4), ("batch", "model"))
X = jax.ShapeDtypeStruct((BATCH, TOKENS, WIDTH), np.float32)
Y = jax.ShapeDtypeStruct((BATCH, TOKENS, OUT), np.float32)
# The head's kernel and bias in float32, stored whole on 2x4.
HEAD_GRADIENT_BYTES = (WIDTH * OUT + OUT) * 4


class GatedBlock(keras.layers.Layer):
    """A norm read by a GELU gate and an up projection, their product
    projected back down and added to the block's input."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.gate = keras.layers.Dense(HIDDEN, activation="gelu", name="gate")
        self.up = keras.layers.Dense(HIDDEN, name="up")
        self.down = keras.layers.Dense(WIDTH, name="down")

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.gate.build(input_shape)
        self.up.build(input_shape)
        self.down.build((*input_shape[:-1], HIDDEN))

    def call(self, x):
        normed = self.norm(x)
        return x + self.down(self.gate(normed) * self.up(normed))


def gated_blocks():
    x = keras.Input((TOKENS, WIDTH))
    h = x
    for i in range(2):
        h = GatedBlock(name=f"block_{i}")(h)
    return keras.Model(x, keras.layers.Dense(OUT, name="head")(h))


@functools.cache
def planned_and_compiled():
    """(plan, compiled peak bytes, peak buffers, optimized HLO text)."""
    plan = ka.plan(gated_blocks, MESH_2x4, X, hardware="h100-80gb")
    compiled, peak, hlo_text = compiled_with_dump(gated_blocks, plan, (X, Y))
    return plan, compiled.compiled_peak_bytes, peak, hlo_text


def test_the_top_block_peaks_before_any_of_its_weight_gradients_is_made():
    # JAX names a Dense kernel's gradient product `<layer>/transpose` and
    # its input's `<layer>/dot_general`; XLA:GPU makes the top block's
    # weight gradients (its gate and up projections' merged into one
    # product) after the peak, inside that block's backward pass.
    plan, _, peak, hlo_text = planned_and_compiled()
    assert plan.rematerialize == ()
    assert "transpose(jvp(block_1))/gate/transpose" in hlo_text
    at_peak = [b for b in peak.buffers if b.part == "backward"]
    assert any(b.layer == "block_1" for b in at_peak), at_peak
    weight_gradients = [
        b for b in at_peak if b.layer == "block_1" and b.op_name.endswith("/transpose")
    ]
    assert not weight_gradients, weight_gradients


def test_the_estimate_holds_none_of_the_top_blocks_gradients_at_its_stage():
    """Measured (estimate / compiled peak): 0.90 (0.96 with the top block's
    gradients counted; the estimate under-counts this block's kept
    activations, the gate and up projections' forward partials, 2 MiB a
    block at the peak, and over-counts its workspace). The zoo's Gemma on
    2x4 went 1.11 -> 1.06, its Llama 0.95 -> 0.90."""
    plan, compiled_peak, *_ = planned_and_compiled()
    assert plan.estimate.gradient_bytes == HEAD_GRADIENT_BYTES
    ratio = plan.estimate.peak_bytes / compiled_peak
    assert 0.9 <= ratio <= 1.1, (plan.estimate.to_dict(), compiled_peak)


def test_a_rematerialized_block_holds_its_gradients_with_its_inputs():
    # Its optimization barrier returns the weight gradients with the input
    # gradient: the fullest stage (block_0's, every block rematerialized)
    # holds every gradient, its own included (808000 bytes, block_0's own
    # left out, if the rule took rematerialized layers too).
    free, *_ = planned_and_compiled()
    rematerialized = ka.plan(
        gated_blocks, MESH_2x4, X, hardware="h100-80gb", rematerialize="all"
    )
    assert rematerialized.rematerialize == ("block_0", "block_1")
    every_gradient = rematerialized.bytes_per_device()
    assert free.estimate.gradient_bytes == HEAD_GRADIENT_BYTES
    assert rematerialized.estimate.gradient_bytes >= every_gradient
