"""Grouped and depthwise convolutions: the planner lays their inputs out so
that XLA computes the filter gradient right, and trains like one device.

XLA's SPMD partitioner (jax 0.10.2, shown by the first test in plain JAX)
sums a grouped convolution's filter gradient over every device when the
input's batch is cut over part of the mesh only: 4 times too large on 2x4.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import keras_autoshard as ka
from tests.parity import check_parity

MESH_2x4 = ka.MeshSpec((2, 4), ("batch", "model"))


def _depthwise_loss(kernel, x):
    y = jax.lax.conv_general_dilated(
        x,
        kernel,
        (1,),
        [(2, 0)],
        dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=8,
    )
    return jnp.sum(y**2)


@pytest.mark.parametrize(
    "x_spec, correct",
    [(P("batch"), False), (P("batch", None, "model"), True), (P(), True)],
    ids=["batch-on-part-of-mesh", "batch-and-channels", "replicated"],
)
def test_xla_filter_gradient_of_a_grouped_conv_depends_on_the_layout(x_spec, correct):
    """The XLA behaviour the planner works around: if this starts passing
    for the first case, the rule (`GroupedConv`) may be dropped."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("batch", "model"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16, 8)).astype("float32")
    kernel = rng.standard_normal((3, 1, 8)).astype("float32")
    expected = jax.jit(jax.grad(_depthwise_loss))(kernel, x)
    placed = jax.device_put(x, NamedSharding(mesh, x_spec))
    actual = jax.jit(jax.grad(_depthwise_loss))(kernel, placed)
    close = np.allclose(actual, expected, rtol=1e-5, atol=1e-5)
    assert close == correct


def depthwise_model():
    inputs = keras.Input((16, 8), name="sequence")
    hidden = keras.layers.Dense(32, name="up")(inputs)
    hidden = keras.layers.DepthwiseConv1D(3, padding="same", name="mix")(hidden)
    return keras.Model(inputs, keras.layers.Dense(8, name="down")(hidden))


def test_a_depthwise_conv_model_trains_like_one_device_on_2x4():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16, 8)).astype("float32")
    y = rng.standard_normal((8, 16, 8)).astype("float32")
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    check_parity(depthwise_model, dist, x, y, steps=3)
    plan = dist.plan
    assert plan.batch_axis == "batch"
    # With the batch on 'batch', the depthwise channels take 'model'.
    assert plan.variable("mix/kernel").spec[1] == "model", plan.summary()


class CausalDepthwise(keras.layers.Layer):
    """A causal depthwise conv over the sequence with a (channels, width)
    weight, as in gated-delta-rule linear attention (Qwen3.5)."""

    def build(self, input_shape):
        self.weight = self.add_weight(shape=(input_shape[-1], 3), name="weight")

    def call(self, x):
        padded = keras.ops.pad(x, [[0, 0], [2, 0], [0, 0]])
        kernel = keras.ops.expand_dims(keras.ops.transpose(self.weight), -1)
        return keras.ops.depthwise_conv(padded, kernel, strides=1, padding="valid")


def narrow_depthwise_model():
    inputs = keras.Input((16, 8), name="sequence")
    hidden = keras.layers.Dense(6, name="up")(inputs)  # 6 channels: 4 ∤ 6
    hidden = CausalDepthwise(name="mix")(hidden)
    return keras.Model(inputs, keras.layers.Dense(8, name="down")(hidden))


def test_a_depthwise_conv_whose_channels_do_not_divide_cuts_the_batch_everywhere():
    # The channels (6) cannot take 'model' (4), so the batch cut over 'batch'
    # alone would break the filter gradient: it is cut over both axes
    # (`MeshAxis.spanning`, tests/planner/test_spanning_batch.py), where it was kept
    # whole before.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16, 8)).astype("float32")
    y = rng.standard_normal((8, 16, 8)).astype("float32")
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    check_parity(narrow_depthwise_model, dist, x, y, steps=3)
    assert dist.plan.batch_axis == ("batch", "model")
    assert not [n for n in dist.plan.notes if n.startswith("The batch of")]


def test_a_batch_no_axis_spanning_the_mesh_divides_is_kept_whole_and_said():
    # 4 rows: 'batch' (2) divides them, both axes together (8) do not.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16, 8)).astype("float32")
    y = rng.standard_normal((4, 16, 8)).astype("float32")
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    with pytest.warns(UserWarning, match="grouped convolution in layer 'mix'"):
        check_parity(narrow_depthwise_model, dist, x, y, steps=3)
    assert dist.plan.batch_axis is None
