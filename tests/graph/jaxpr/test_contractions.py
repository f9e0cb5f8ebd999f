"""The contraction rules (`graph/jaxpr/contractions.py`) on tiny jaxprs."""

import jax.numpy as jnp
from jax import lax

from keras_autoshard.graph.jaxpr import contractions
from tests.graph.jaxpr.small_graphs import (
    class_of,
    family_primitives,
    graph_of,
    named,
    output,
)


def test_the_family_rules_matrix_products_and_convolutions():
    assert family_primitives(contractions) == {"dot_general", "conv_general_dilated"}


def test_a_matrix_product_unifies_free_dims_with_the_output_and_contracting_dims():
    graph = graph_of(
        lambda w, x: x @ w, ("param", "w", (16, 32)), ("input", "x", (8, 16))
    )
    w, x, out = named(graph, "w"), named(graph, "x"), output(graph)
    assert x.dim_classes[1] == w.dim_classes[0]
    assert out.dim_classes == (x.dim_classes[0], w.dim_classes[1])
    assert len(graph.classes) == 3 and all(c.shardable for c in graph.classes)
    events = {(e.kind, e.phase, e.classes, e.tensor) for e in graph.comm_events}
    # Cutting the contracted features leaves partial sums of the output;
    # cutting the tokens leaves the weight's gradient partial. The input
    # carries no gradient: no backward event on it.
    assert events == {
        ("contract", "forward", (w.dim_classes[0],), out.id),
        ("contract", "backward", (x.dim_classes[0],), w.id),
    }


def test_batch_dims_of_a_product_are_one_class_across_operands_and_output():
    graph = graph_of(
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        ("input", "a", (4, 8, 16)),
        ("input", "b", (4, 16, 32)),
    )
    a, b, out = named(graph, "a"), named(graph, "b"), output(graph)
    assert a.dim_classes[0] == b.dim_classes[0] == out.dim_classes[0]
    assert a.dim_classes[2] == b.dim_classes[1]
    assert out.dim_classes[1:] == (a.dim_classes[1], b.dim_classes[2])


def _conv(groups):
    def f(kernel, x):
        return lax.conv_general_dilated(
            x,
            kernel,
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=groups,
        )

    return f


def test_a_convolution_keeps_spatial_dims_whole_and_unifies_batch_and_features():
    graph = graph_of(
        _conv(1), ("param", "kernel", (3, 3, 4, 8)), ("input", "x", (2, 10, 10, 4))
    )
    kernel, x, out = named(graph, "kernel"), named(graph, "x"), output(graph)
    assert out.dim_classes[0] == x.dim_classes[0]
    assert x.dim_classes[3] == kernel.dim_classes[2]
    assert out.dim_classes[3] == kernel.dim_classes[3]
    for tensor, dim in ((x, 1), (x, 2), (out, 1), (kernel, 0), (kernel, 1)):
        reason = class_of(graph, tensor, dim).unshardable_reason
        assert reason == "spatial dim of conv_general_dilated"
    assert graph.grouped_convs == ()


def test_a_grouped_convolution_keeps_its_features_whole_and_is_recorded():
    graph = graph_of(
        _conv(2), ("param", "kernel", (3, 3, 2, 8)), ("input", "x", (2, 10, 10, 4))
    )
    x, out = named(graph, "x"), output(graph)
    assert class_of(graph, x, 3).unshardable_reason == "grouped conv_general_dilated"
    assert class_of(graph, out, 3).unshardable_reason == "grouped conv_general_dilated"
    assert [(g.tensor, g.feature_dim) for g in graph.grouped_convs] == [(x.id, 3)]


def test_a_depthwise_convolution_cuts_its_channels_as_whole_groups():
    graph = graph_of(
        _conv(4), ("param", "kernel", (3, 3, 1, 4)), ("input", "x", (2, 10, 10, 4))
    )
    kernel, x, out = named(graph, "kernel"), named(graph, "x"), output(graph)
    assert x.dim_classes[3] == out.dim_classes[3] == kernel.dim_classes[3]
    assert class_of(graph, x, 3).shardable
