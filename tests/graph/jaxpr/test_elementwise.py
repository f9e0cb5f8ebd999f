"""The elementwise, identity, fresh-value and random rules
(`graph/jaxpr/elementwise.py`) on tiny jaxprs."""

import jax.numpy as jnp
from jax import lax

from keras_autoshard.graph.jaxpr import elementwise
from tests.graph.jaxpr.small_graphs import (
    class_of,
    family_primitives,
    graph_of,
    named,
    output,
)


def test_the_family_rules_elementwise_identity_fresh_and_random_primitives():
    primitives = family_primitives(elementwise)
    assert {"add", "mul", "tanh", "select_n", "convert_element_type"} <= primitives
    assert {"optimization_barrier", "iota", "random_bits"} <= primitives
    assert {"bitcast_convert_type"} <= primitives
    assert not {"dot_general", "broadcast_in_dim", "reduce_sum"} & primitives


def test_operands_of_one_shape_share_every_class_with_the_output():
    graph = graph_of(
        lambda w, x: jnp.tanh(x * w), ("param", "w", (8, 16)), ("input", "x", (8, 16))
    )
    w, x, out = named(graph, "w"), named(graph, "x"), output(graph)
    assert w.dim_classes == x.dim_classes == out.dim_classes
    assert len(graph.classes) == 2
    # Nothing is broadcast or contracted: no communication.
    assert graph.comm_events == ()


def test_a_scalar_weight_broadcast_over_the_output_has_its_gradient_reduced():
    graph = graph_of(
        lambda s, x: lax.mul(x, s), ("param", "s", ()), ("input", "x", (8, 16))
    )
    s, out = named(graph, "s"), output(graph)
    (event,) = graph.comm_events
    assert (event.kind, event.phase, event.tensor) == (
        "broadcast_grad",
        "backward",
        s.id,
    )
    assert set(event.classes) == set(out.dim_classes)


def test_a_precision_cast_of_a_weight_is_a_view_of_it():
    graph = graph_of(lambda w: w.astype(jnp.bfloat16), ("param", "w", (8, 16)))
    w, out = named(graph, "w"), output(graph)
    assert out.dim_classes == w.dim_classes
    assert out.itemsize == 2
    assert graph.param_casts == ((out.id, w.id),)


def test_an_optimization_barrier_passes_each_operand_through():
    graph = graph_of(
        lambda a, b: lax.optimization_barrier((a, b)),
        ("input", "a", (8, 16)),
        ("input", "b", (4,)),
    )
    assert output(graph, 0).dim_classes == named(graph, "a").dim_classes
    assert output(graph, 1).dim_classes == named(graph, "b").dim_classes


def test_a_bitcast_that_changes_the_shape_keeps_every_dim_whole():
    graph = graph_of(
        lambda x: lax.bitcast_convert_type(x, jnp.uint16), ("input", "x", (8, 16))
    )
    x, out = named(graph, "x"), output(graph)
    assert out.shape == (8, 16, 2)
    for tensor, dims in ((x, (0, 1)), (out, (0, 1, 2))):
        for dim in dims:
            reason = class_of(graph, tensor, dim).unshardable_reason
            assert reason == "bitcast_convert_type changing the shape"
