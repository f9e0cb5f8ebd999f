"""What one device holds at the fullest stage of XLA:GPU's backward pass
(`planner/accelerator_peak.py`) and the residuals it counts there
(`graph/fusion.py`'s accelerator rules), on a convolution, a max pooling
and a Dense written here, traced over shapes only."""

import functools

import jax
import keras
import pytest

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.graph.builder import build_axis_graph
from keras_autoshard.planner.accelerator_peak import accelerator_peak
from keras_autoshard.planner.cost_model import Assignment
from keras_autoshard.trace.tracer import trace_model

BATCH, SIDE, CHANNELS = 2, 8, 4
# Bytes of the pooling's operand (2 x 8 x 8 x 4 floats) and output (2 x 4 x 4 x 4).
OPERAND, POOLED = 4 * BATCH * SIDE * SIDE * CHANNELS, 4 * BATCH * 4 * 4 * CHANNELS


@functools.cache
def pooling_graph(activation: str, platform: str = "gpu") -> AxisGraph:
    x = keras.Input((SIDE, SIDE, 3), batch_size=BATCH)
    h = keras.layers.Conv2D(
        CHANNELS, 3, padding="same", activation=activation, name="conv"
    )(x)
    h = keras.layers.MaxPooling2D(name="pool")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    model = keras.Model(x, keras.layers.Dense(2, name="head")(h))
    traced = trace_model(model, jax.ShapeDtypeStruct((BATCH, SIDE, SIDE, 3), "float32"))
    graph = build_axis_graph(traced.closed_jaxpr, traced.invar_kinds)
    return graph.for_platform(platform)


def _pooling(graph: AxisGraph):
    ((operand, output),) = graph.poolings
    return graph.tensors[operand], graph.tensors[output]


@pytest.mark.parametrize("activation, relu", [("relu", 1), ("tanh", 0)])
def test_a_max_pooled_relu_keeps_its_zero(activation, relu):
    graph = pooling_graph(activation)
    operand, output = _pooling(graph)
    assert (operand.shape, output.shape) == ((2, 8, 8, 4), (2, 4, 4, 4))
    kept = [k for k in graph.residuals if k.layers == ("pool",)]
    # A ReLU's zero, one buffer of the operand's size, from the forward
    # pass; the maxima's positions are made late, at the pooling's stage.
    assert [(k.tensor, k.scale) for k in kept] == [(operand.id, 1.0)] * relu


def test_the_poolings_stage_scatters_the_operands_gradient():
    graph = pooling_graph("tanh")
    kept, gradients, workspace = accelerator_peak(
        graph, Assignment({}), {}, frozenset()
    )
    # At the pooling's backward stage: its output's gradient and the
    # positions of the maxima read (one int32 array per operand dim, 4, of
    # the output's 128 elements: 2048 bytes, the operand's own size), the
    # operand's gradient scattered into a zeroed buffer beside them.
    assert workspace == OPERAND + POOLED + OPERAND
    # Kept there: the tanh output the pooling reads.
    assert kept == OPERAND
    # The head's gradients are made; the convolution's come below.
    assert gradients == 4 * (4 * 4 * CHANNELS * 2 + 2)


def test_the_heads_stage_holds_the_loss_gradient_of_its_output():
    """The loss writes the gradient of an output a product makes in
    float32, and the head's backward pass reads it into both of its
    products: live through the head's stage, beside its workspace."""
    x = keras.Input((16,), batch_size=BATCH)
    model = keras.Model(x, keras.layers.Dense(256, name="head")(x))
    traced = trace_model(model, jax.ShapeDtypeStruct((BATCH, 16), "float32"))
    graph = build_axis_graph(traced.closed_jaxpr, traced.invar_kinds)
    graph = graph.for_platform("gpu")
    _, gradients, workspace = accelerator_peak(graph, Assignment({}), {}, frozenset())
    # Nothing else is formed there: no activation but the output, no split
    # product (2 tokens), no batch reduction.
    assert workspace == 4 * BATCH * 256
    assert gradients == 4 * (16 * 256 + 256)
