"""Models the coverage sweep plans at one batch and sequence length, planned
at KerasHub's own test shapes (batch 2 x 5 tokens, heads of one feature)
and at 8 x 16: size coincidences change how reshapes factor, and a tiny
config makes tensors a sweep config never does (a rotary share of 0
features).

Two rules are specified here on models written in the test, then on the
KerasHub backbones that showed them: a reshape of an empty tensor keeps the
dims that match (GPT-NeoX kept its batch whole), and a layer whose call
returns several tensors is never pinned (XLNet could not be built under its
plan's distribution).
"""

import jax
import jax.numpy as jnp
import keras
import keras_hub
import numpy as np
import pytest

import keras_autoshard as ka
from keras_autoshard.graph.builder import build_axis_graph
from tests.parity import assert_close, build_pair, check_parity, distribute_batch

MESH_2x4 = ka.MeshSpec((2, 4), ("batch", "model"))
# (batch, sequence length): KerasHub's backbone tests, and the sweep's sizes.
SHAPES = [(2, 5), (8, 16)]


class ZeroWidthRotation(keras.layers.Layer):
    """A rotary embedding's half rotation (`stack((-x2, x1), -2)`, reshaped
    back) of the first `width` features; GPT-NeoX's share of a one-feature
    head rounds down to width 0."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.width = width

    def call(self, x):
        rotated, rest = x[..., : self.width], x[..., self.width :]
        x1, x2 = keras.ops.split(rotated, 2, axis=-1)
        halves = keras.ops.stack((-x2, x1), axis=-2)
        rotated = keras.ops.reshape(halves, keras.ops.shape(rotated))
        return keras.ops.concatenate([rotated, rest], axis=-1)


def zero_width_rotation_model(seq):
    inputs = keras.Input((seq, 8), name="features")
    hidden = keras.layers.Dense(8, name="up")(inputs)
    hidden = ZeroWidthRotation(0, name="rotation")(hidden)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(hidden))


def _reshape_graph(in_shape, out_shape):
    closed = jax.make_jaxpr(lambda x: jnp.reshape(x, out_shape))(
        jax.ShapeDtypeStruct(in_shape, "float32")
    )
    graph = build_axis_graph(closed, [("input", "x")])
    return graph, graph.tensors[0], graph.tensors[graph.outputs[0]]


def test_a_reshape_of_an_empty_tensor_maps_the_dims_that_match_at_either_end():
    graph, x, out = _reshape_graph((4, 3, 2, 0), (4, 3, 0))
    assert [x.dim_classes[d] for d in (0, 1, 3)] == list(out.dim_classes)
    assert graph.classes[x.dim_classes[0]].shardable


def test_a_reshape_of_an_empty_tensor_keeps_the_dims_between_whole():
    graph, x, out = _reshape_graph((4, 3, 0), (4, 0, 3))
    assert x.dim_classes[0] == out.dim_classes[0]
    reason = "reshape (4, 3, 0)->(4, 0, 3) of an empty tensor"
    for tensor in (x, out):
        for dim in (1, 2):
            assert graph.classes[tensor.dim_classes[dim]].unshardable_reason == reason


@pytest.mark.parametrize("batch, seq", SHAPES)
def test_a_zero_width_rotation_splits_the_batch_and_trains_like_one_device(batch, seq):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, seq, 8)).astype("float32")
    y = rng.standard_normal((batch, seq, 4)).astype("float32")
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    check_parity(lambda: zero_width_rotation_model(seq), dist, x, y, steps=1)
    batch_notes = [n for n in dist.plan.notes if n.startswith("The batch of")]
    assert dist.plan.batch_axis == "batch", batch_notes


class TwoOutputs(keras.layers.Layer):
    """Returns two tensors, the second read by nothing and made last, and
    owns a weight no equation reads (stored cut, so the planner would pin
    the layer's output): as XLNet's attention mask layer."""

    def build(self, input_shape):
        self.unused = self.add_weight(shape=(8, 8), name="unused")

    def call(self, x):
        return x * 2.0, x[:, :1] * 3.0


def two_outputs_model():
    inputs = keras.Input((8,), name="features")
    hidden = keras.layers.Dense(8, name="up")(inputs)
    kept, _ = TwoOutputs(name="two_outputs")(hidden)
    return keras.Model(inputs, keras.layers.Dense(8, name="head")(kept))


def test_a_layer_returning_two_tensors_is_not_pinned_and_builds_under_the_plan():
    x = np.random.default_rng(0).standard_normal((8, 8)).astype("float32")
    plan = ka.plan(two_outputs_model(), MESH_2x4, sample_input=x)
    assert "two_outputs/output" not in [a.path for a in plan.activations]
    reference, sharded = build_pair(two_outputs_model, ka.PlanDistribution(plan))
    assert_close(sharded(x), reference(x), "forward output")


class Halves(keras.layers.Layer):
    def call(self, x):
        return x[:, :4], x[:, 4:]


def test_a_layer_whose_two_outputs_are_both_read_returns_several_tensors():
    inputs = keras.Input((8,), name="features")
    first, second = Halves(name="halves")(keras.layers.Dense(8, name="up")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(first + second))
    graph = _graph(model, np.zeros((8, 8), "float32"))
    assert graph.several_outputs == ("halves",)


def _graph(model, x):
    from keras_autoshard.trace.tracer import trace_model

    traced = trace_model(model, x)
    return build_axis_graph(traced.closed_jaxpr, traced.invar_kinds)


# KerasHub's backbone test configurations (gpt_neo_x and xlnet
# *_backbone_test.py): two heads of one feature each.
TINY = dict(
    vocabulary_size=10, num_layers=2, num_heads=2, hidden_dim=2, intermediate_dim=4
)


def _token_inputs(batch, seq, segments=False):
    rng = np.random.default_rng(0)
    inputs = {
        "token_ids": rng.integers(0, 10, (batch, seq)).astype("int32"),
        "padding_mask": np.ones((batch, seq), "int32"),
    }
    if segments:
        inputs["segment_ids"] = np.zeros((batch, seq), "int32")
    return inputs


def _plan_build_and_compare(build, inputs):
    """Plan `build()` on 2x4, build it again under the plan's distribution
    and compare its forward pass with one device's; return the plan."""
    plan = ka.plan(build(), MESH_2x4, sample_input=inputs)
    distribution = ka.PlanDistribution(plan)
    reference, sharded = build_pair(build, distribution)
    with distribution.scope():
        outputs = sharded(distribute_batch(distribution, inputs))
    assert_close(outputs, reference(inputs), "forward output")
    return plan


@pytest.mark.parametrize("batch, seq", SHAPES)
def test_gpt_neo_x_splits_the_batch_with_a_rotary_share_of_zero_features(batch, seq):
    def build():
        return keras_hub.models.GPTNeoXBackbone(**TINY, max_sequence_length=max(5, seq))

    plan = _plan_build_and_compare(build, _token_inputs(batch, seq))
    batch_notes = [n for n in plan.notes if n.startswith("The batch of")]
    assert plan.batch_axis == "batch", batch_notes


@pytest.mark.parametrize("batch, seq", SHAPES)
def test_xlnet_builds_under_its_plan_and_keeps_the_batch_whole_naming_its_reshape(
    batch, seq
):
    """XLNet's attention mask layer reshapes the (batch, seq) padding mask to
    (seq, batch) (`ops.reshape`, not a transpose) and reads the minor dim as
    the batch: each of its rows mixes tokens of several batch rows. When
    batch == seq (the sweep's 8 x 8) the reshape keeps every dim and the
    batch is split; otherwise the note names that reshape."""
    inputs = _token_inputs(batch, seq, segments=True)
    plan = _plan_build_and_compare(
        lambda: keras_hub.models.XLNetBackbone(**TINY), inputs
    )
    assert plan.batch_axis is None
    batch_notes = [n for n in plan.notes if n.startswith("The batch of")]
    assert batch_notes
    for note in batch_notes:
        assert f"reshape ({batch}, {seq})->({seq}, {batch})" in note, note
        assert "in layer 'encoder_block_attn_mask_layer'" in note, note
